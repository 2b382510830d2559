"""SGLang answers a reload from disk with HTTP 400 "Weights were updated, but the cache was not
flushed ..." when a request it has just answered is still counted as running (seen live, right after
a generate returned). The weights did change, but the version label did not: the client must not
report that the server keeps the old weights, and must not load the checkpoint again either; it
flushes the cache (asking again while SGLang refuses) and sets the label. A stand-in server answers
the three routes (the race cannot be staged on demand against a real server)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import megarl.rollout.sglang_client as sglang_client
from megarl.rollout.sglang_client import UNFLUSHED, SGLangEngine
from megarl.rollout.types import RolloutError, WeightsDirError

REFUSED = {"success": False, "message": f"{UNFLUSHED} because requests are still running or queued."}
OK = {"success": True, "message": "ok"}
BUSY = {"success": False, "message": "Cache not flushed: requests are running."}


def _serve(answers: dict[str, list[tuple[int, dict]]], seen: list[tuple[str, dict | None]]):
    """A server answering each path with its ``answers`` in order (the last one again); ``seen``
    gets (path, JSON body or None) of every call."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server API name
            n = int(self.headers.get("Content-Length") or 0)
            raw_in = self.rfile.read(n) if n else b""
            seen.append((self.path, json.loads(raw_in) if raw_in else None))
            calls = sum(1 for p, _ in seen if p == self.path)
            replies = answers[self.path]
            code, body = replies[min(calls, len(replies)) - 1]
            raw = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


async def _reload(url: str, version: str) -> SGLangEngine:
    eng = SGLangEngine(url)
    try:
        await eng.update_weights("/models/v2", version, check_dir=False)
    finally:
        await eng.close()
    return eng


def _paths(seen: list[tuple[str, dict | None]]) -> list[str]:
    return [p for p, _ in seen]


@pytest.mark.parametrize("busy", [0, 2])
def test_an_unflushed_reload_is_flushed_and_labelled_without_loading_again(busy):
    seen: list[tuple[str, dict | None]] = []
    server = _serve(
        {
            "/update_weights_from_disk": [(400, REFUSED)],
            "/flush_cache": [(400, BUSY)] * busy + [(200, OK)],
            "/update_weight_version": [(200, OK)],
        },
        seen,
    )
    try:
        eng = asyncio.run(_reload(f"http://127.0.0.1:{server.server_port}", "v2"))
    finally:
        server.shutdown()
    assert eng.weight_version == "v2"
    assert _paths(seen) == ["/update_weights_from_disk"] + ["/flush_cache"] * (busy + 1) + [
        "/update_weight_version"
    ]
    assert seen[0][1] == {"model_path": "/models/v2", "weight_version": "v2"}
    assert seen[-1][1] == {"new_version": "v2", "abort_all_requests": False}


def test_a_flush_that_never_goes_through_is_an_error_that_says_the_weights_changed(monkeypatch):
    monkeypatch.setattr(sglang_client, "UNFLUSHED_RETRY_S", 0.5)
    seen: list[tuple[str, dict | None]] = []
    server = _serve({"/update_weights_from_disk": [(400, REFUSED)], "/flush_cache": [(400, BUSY)]}, seen)
    try:
        with pytest.raises(
            RolloutError, match="were loaded, but the cache of the old weights could not be flushed"
        ) as e:
            asyncio.run(_reload(f"http://127.0.0.1:{server.server_port}", "v2"))
    finally:
        server.shutdown()
    assert not isinstance(e.value, WeightsDirError)
    assert _paths(seen).count("/update_weights_from_disk") == 1 and _paths(seen).count("/flush_cache") >= 2
    assert "/update_weight_version" not in _paths(seen)


def test_another_refusal_still_keeps_the_old_weights():
    seen: list[tuple[str, dict | None]] = []
    server = _serve(
        {
            "/update_weights_from_disk": [
                (400, {"success": False, "message": "Failed to get weights iterator"})
            ]
        },
        seen,
    )
    try:
        with pytest.raises(WeightsDirError, match="keeps the old weights"):
            asyncio.run(_reload(f"http://127.0.0.1:{server.server_port}", "v2"))
    finally:
        server.shutdown()
    assert _paths(seen) == ["/update_weights_from_disk"]
