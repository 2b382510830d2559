"""A minimal asyncio HTTP/1.1 server (keep-alive, Content-Length bodies) for the authenticating
forwarder and the SGLang replay stand-in; no web framework needed in the project venv."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    411: "Length Required",
    413: "Payload Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
MAX_BODY = 64 * 1024 * 1024


@dataclass
class Request:
    method: str
    target: str  # path with query string
    headers: dict[str, str]  # lower-case names
    body: bytes
    peer: tuple | None = None

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def query(self) -> str:
        return self.target.split("?", 1)[1] if "?" in self.target else ""


@dataclass
class Response:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    drop_connection: bool = False  # close without answering (what a crashing server does)


Handler = Callable[[Request], Awaitable[Response]]


class MiniServer:
    """Serve ``handler`` on ``host:port`` (port 0 picks a free one; see ``.port`` after ``start``)."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0):
        self.handler, self.host, self.port = handler, host, port
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> MiniServer:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        """Stop listening and drop every open connection."""
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        peer = writer.get_extra_info("peername")
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                try:
                    method, target, _version = lines[0].split(" ", 2)
                except ValueError:
                    await self._write(writer, Response(400, b"bad request line"), close=True)
                    return
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                if "chunked" in headers.get("transfer-encoding", "").lower():
                    await self._write(writer, Response(411, b"chunked bodies are not supported"), close=True)
                    return
                length = int(headers.get("content-length", "0") or 0)
                if length > MAX_BODY:
                    await self._write(writer, Response(413, b"body too large"), close=True)
                    return
                body = await reader.readexactly(length) if length else b""
                resp = await self.handler(Request(method, target, headers, body, peer))
                if resp.drop_connection:
                    writer.transport.abort()
                    return
                close = headers.get("connection", "").lower() == "close"
                await self._write(writer, resp, close)
                if close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            if not writer.is_closing():
                writer.close()

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, resp: Response, close: bool) -> None:
        hdrs = {k.lower(): v for k, v in resp.headers.items()}
        hdrs.pop("transfer-encoding", None)
        hdrs["content-length"] = str(len(resp.body))
        hdrs["connection"] = "close" if close else "keep-alive"
        head = (
            f"HTTP/1.1 {resp.status} {REASONS.get(resp.status, 'Status')}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
            + "\r\n"
        )
        writer.write(head.encode("latin-1") + resp.body)
        await writer.drain()
