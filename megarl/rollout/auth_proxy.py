"""Authenticating forwarder in front of an engine that only this user can reach.

vLLM's ``--api-key`` guards only ``/v1/*``; its dev-mode control routes (``/collective_rpc``,
``/pause``, ``/resume``...) answer anyone who reaches the server. So vLLM listens on a Unix
socket in a 0700 directory and this forwarder listens on the node's job-network address (or
loopback): each route needs the generation key or the admin key (constant-time comparison),
unknown routes are refused (deny by default), and allowed requests are forwarded to the engine.

Run: ``python -m megarl.rollout.auth_proxy --listen HOST:PORT --upstream-uds SOCKET`` (what the
launcher starts) or ``--upstream http://127.0.0.1:PORT``, with the keys in the environment
(``MEGARL_ROLLOUT_API_KEY``/``..._ADMIN_KEY``) or a 0600 key file (``MEGARL_ROLLOUT_KEY_FILE``).
Prints ``READY <url>`` once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import signal
import sys

import httpx

from megarl.rollout.keys import RolloutKeys
from megarl.rollout.miniserver import MiniServer, Request, Response

OPEN, API, ADMIN = "open", "api", "admin"

# Route -> key needed, for vLLM's OpenAI server in dev mode. Anything not listed is refused.
VLLM_ROUTES: dict[str, str] = {
    "/health": OPEN,
    "/v1/completions": API,
    "/v1/chat/completions": API,
    "/v1/models": API,
    "/tokenize": API,
    "/detokenize": API,
    "/weight_info": API,
    "/pause": ADMIN,
    "/resume": ADMIN,
    "/is_paused": ADMIN,
    "/collective_rpc": ADMIN,
    "/reset_prefix_cache": ADMIN,
    "/update_weight_version": ADMIN,
    "/sleep": ADMIN,
    "/wake_up": ADMIN,
    "/is_sleeping": ADMIN,
    "/abort_requests": ADMIN,
}
HOP_HEADERS = {
    "host",
    "authorization",
    "connection",
    "content-length",
    "transfer-encoding",
    "keep-alive",
    "x-api-key",
}


def _json_error(status: int, message: str) -> Response:
    body = json.dumps({"error": {"message": message, "type": "auth_proxy", "code": status}}).encode()
    return Response(status, body, {"content-type": "application/json"})


class AuthProxy:
    """Check the key of each request against ``routes``, then forward it to ``upstream``."""

    def __init__(
        self,
        upstream: str,
        keys: RolloutKeys,
        routes: dict[str, str] = VLLM_ROUTES,
        upstream_key: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 600.0,
        upstream_uds: str | None = None,
    ):
        self.keys, self.routes = keys, routes
        self.upstream_key = upstream_key if upstream_key is not None else keys.api_key
        transport = httpx.AsyncHTTPTransport(uds=upstream_uds) if upstream_uds else None
        self._client = httpx.AsyncClient(
            base_url=upstream.rstrip("/"),
            timeout=timeout_s,
            limits=httpx.Limits(max_connections=256),
            transport=transport,
        )
        self.server = MiniServer(self.handle, host, port)

    async def start(self) -> AuthProxy:
        await self.server.start()
        return self

    @property
    def url(self) -> str:
        return self.server.url

    async def stop(self) -> None:
        await self.server.stop()
        await self._client.aclose()

    def _key_ok(self, req: Request, needed: str) -> bool:
        if needed == OPEN:
            return True
        auth = req.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else ""
        want = self.keys.admin_key if needed == ADMIN else self.keys.api_key
        return bool(given) and hmac.compare_digest(given.encode(), want.encode())

    async def handle(self, req: Request) -> Response:
        needed = self.routes.get(req.path)
        if needed is None:
            return _json_error(404, f"route {req.path} is not exposed by the rollout forwarder")
        if not self._key_ok(req, needed):
            return _json_error(401, f"route {req.path} needs the {needed} key (Authorization: Bearer ...)")
        headers = {k: v for k, v in req.headers.items() if k not in HOP_HEADERS}
        if self.upstream_key:
            headers["authorization"] = f"Bearer {self.upstream_key}"
        try:
            up = await self._client.request(req.method, req.target, content=req.body, headers=headers)
        except httpx.HTTPError as e:
            return _json_error(502, f"upstream engine unreachable: {type(e).__name__}: {e}")
        out_headers = {k: v for k, v in up.headers.items() if k.lower() in ("content-type",)}
        return Response(up.status_code, up.content, out_headers)


async def _main(args: argparse.Namespace) -> None:
    keys = RolloutKeys.from_env()
    host, port = args.listen.rsplit(":", 1)
    upstream = args.upstream or "http://localhost"
    proxy = await AuthProxy(upstream, keys, host=host, port=int(port), upstream_uds=args.upstream_uds).start()
    print(f"READY {proxy.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await proxy.stop()


def main(argv: list[str] | None = None) -> None:
    """Command-line entry of the forwarder (keys from the environment or a key file only)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--listen", required=True, help="HOST:PORT to listen on (the node's job-network address)")
    up = p.add_mutually_exclusive_group(required=True)
    up.add_argument("--upstream", help="URL of the loopback engine, e.g. http://127.0.0.1:8000")
    up.add_argument("--upstream-uds", help="Unix socket of the engine (in a 0700 directory)")
    args = p.parse_args(argv)
    try:
        asyncio.run(_main(args))
    except KeyError as e:
        sys.exit(f"auth_proxy: {e}")


if __name__ == "__main__":
    main()
