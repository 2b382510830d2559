"""A stand-in for ``python -m vllm.entrypoints.openai.api_server`` in process-lifetime tests: it
accepts vLLM's arguments, forks one worker into its process group (as vLLM's engine core is), ignores
SIGTERM in that worker (a helper that outlives a polite stop), and answers ``GET /health`` on
``--uds PATH`` or ``--host``/``--port``. It generates nothing.

Used as the server "python" through a two-line shell script (``stub_python`` in the tests).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import socketserver
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # http.server API name
        code = 200 if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def address_string(self) -> str:  # a Unix socket peer has no (host, port)
        return "stub"

    def log_message(self, *a) -> None:
        pass


class _UnixHTTPServer(socketserver.UnixStreamServer):
    def get_request(self):
        conn, _ = super().get_request()
        return conn, ("stub", 0)


def main() -> None:
    """Parse vLLM-style arguments (``-m MODULE`` first), fork a worker, serve /health forever."""
    argv = sys.argv[1:]
    if argv[:1] == ["-m"]:
        argv = argv[2:]
    p = argparse.ArgumentParser()
    p.add_argument("--uds")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args, _ = p.parse_known_args(argv)
    if os.fork() == 0:  # the "engine core": same process group, deaf to SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(60)
    print(f"stub server pid {os.getpid()}", flush=True)
    if args.uds:
        server = _UnixHTTPServer(args.uds, _Handler)
    else:
        server = HTTPServer((args.host, args.port), _Handler)
        server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.serve_forever()


if __name__ == "__main__":
    main()
