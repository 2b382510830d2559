"""Shared HTTP plumbing of the server clients: one pooled ``httpx.AsyncClient``, keys in headers,
and one mapping from transport failures / HTTP statuses to the rollout error types."""

from __future__ import annotations

import json
from typing import Any

import httpx

from megarl.rollout.engine import RolloutEngine
from megarl.rollout.types import (
    AuthError,
    BadRequestError,
    EngineDeadError,
    EngineUnavailableError,
    RolloutError,
)


def _error_message(resp: httpx.Response) -> str:
    """The server's own error text, whatever shape it came in (OpenAI error, FastAPI detail, text)."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:500]
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])[:500]
    return json.dumps(body)[:500]


class HttpEngine(RolloutEngine):
    """A ``RolloutEngine`` that talks to one HTTP server.

    ``api_key`` is sent on generation routes, ``admin_key`` (default: ``api_key``) on control routes,
    both as ``Authorization: Bearer``. ``timeout_s`` bounds one HTTP call (generation included).
    """

    def __init__(
        self,
        base_url: str,
        *,
        name: str | None = None,
        api_key: str | None = None,
        admin_key: str | None = None,
        timeout_s: float = 600.0,
        max_concurrency: int = 32,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        weight_version: str = "0",
    ):
        base_url = base_url.rstrip("/")
        super().__init__(
            name or base_url,
            max_concurrency=max_concurrency,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            weight_version=weight_version,
        )
        self.base_url = base_url
        self._api_key = api_key
        self._admin_key = admin_key if admin_key is not None else api_key
        self.dead_reason: str | None = None
        self._client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(
                max_connections=max_concurrency + 8, max_keepalive_connections=max_concurrency + 8
            ),
        )

    def _headers(self, admin: bool) -> dict[str, str]:
        key = self._admin_key if admin else self._api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def mark_dead(self, reason: str) -> None:
        """Record that this server cannot serve any more; later calls fail fast with ``EngineDeadError``."""
        if self.dead_reason is None:
            self.dead_reason = reason

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        admin: bool = False,
        params: dict | None = None,
        timeout_s: float | None = None,
        expect_json: bool = True,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One HTTP call; returns the parsed JSON (or text) body, raises a ``RolloutError`` subtype.
        ``content`` sends raw bytes as a JSON body (for contract tests of malformed requests)."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"{self.name}: engine is down ({self.dead_reason})")
        kw: dict[str, Any] = {"headers": {**self._headers(admin), **(headers or {})}, "params": params}
        if json_body is not None:
            kw["json"] = json_body
        elif content is not None:
            kw["content"] = content
            kw["headers"]["content-type"] = "application/json"
        if timeout_s is not None:
            kw["timeout"] = timeout_s
        try:
            resp = await self._client.request(method, path, **kw)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
            reason = f"{method} {path}: {type(e).__name__}: {e or 'connection lost'}"
            self.mark_dead(reason)
            raise EngineDeadError(f"{self.name}: {reason}") from e
        except httpx.TimeoutException as e:
            raise EngineUnavailableError(
                f"{self.name}: {method} {path} timed out ({type(e).__name__})"
            ) from e
        if resp.status_code >= 400:
            self._raise_for_status(method, path, resp, sent_key=bool(self._headers(admin)))
        if not expect_json:
            return resp.text
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text

    def _raise_for_status(self, method: str, path: str, resp: httpx.Response, sent_key: bool = True) -> None:
        msg = f"{self.name}: {method} {path} -> HTTP {resp.status_code}: {_error_message(resp)}"
        code = resp.status_code
        if code in (401, 403):
            if not sent_key:
                msg += (
                    " (no key was sent: give the trainer the servers' keys with rollout.key_file or "
                    "MEGARL_ROLLOUT_KEY_FILE, or MEGARL_ROLLOUT_API_KEY + MEGARL_ROLLOUT_ADMIN_KEY)"
                )
            raise AuthError(msg)
        if code in (400, 404, 413, 422):
            raise BadRequestError(msg)
        if code in (429, 503):
            raise EngineUnavailableError(msg)
        if code >= 500:
            self.mark_dead(msg)
            raise EngineDeadError(msg)
        raise RolloutError(msg)

    async def close(self) -> None:
        await self._client.aclose()
