"""STAND-IN rollout server for the Slurm tests: a stdlib HTTP server with ``/health`` and ``/whoami``.

The real rollout servers (vLLM / SGLang, megarl/rollout) are too slow to start within the CI budget of the
Slurm tests; this one exercises exactly what the launcher owns: start a server command on a rollout node, wait
for its health check, hand its address to the learner, watch it, and tear it down. It does not generate
anything.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main(argv: list[str] | None = None) -> None:
    """Serve until killed."""
    p = argparse.ArgumentParser(prog="python -m megarl.launch.standin_server")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (the launcher passes the node's; 0.0.0.0 = all)",
    )
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    info = {
        "host": socket.gethostname(),
        "node": os.environ.get("MEGARL_NODE", ""),
        "port": args.port,
        "pid": os.getpid(),
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server API name
            if self.path == "/health":
                body = b"ok"
            elif self.path == "/whoami":
                body = json.dumps(info).encode()
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"standin_server: serving on {args.host}:{args.port} host={info['host']}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
