"""SGLang answers a reload from disk with HTTP 400 "Weights were updated, but the cache was not
flushed ..." when a request it has just answered is still counted as running (seen live, right after
a generate returned). The weights did change, so the client must not report that the server keeps
the old ones: it loads again until the flush goes through. A stand-in server answers the reload
route (the race cannot be staged on demand against a real server)."""

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


def _serve(answers: list[tuple[int, dict]], seen: list[dict]):
    """A server whose ``/update_weights_from_disk`` gives ``answers`` in order (the last one again)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server API name
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            code, body = answers[min(len(seen), len(answers)) - 1]
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


@pytest.mark.parametrize("refusals", [1, 3])
def test_an_unflushed_reload_is_loaded_again_until_it_flushes(refusals):
    seen: list[dict] = []
    ok = {"success": True, "message": "Succeeded to update model weights."}
    server = _serve([(400, REFUSED)] * refusals + [(200, ok)], seen)
    try:
        eng = asyncio.run(_reload(f"http://127.0.0.1:{server.server_port}", "v2"))
    finally:
        server.shutdown()
    assert eng.weight_version == "v2"
    assert seen == [{"model_path": "/models/v2", "weight_version": "v2"}] * (refusals + 1)


def test_a_flush_that_never_goes_through_is_an_error_that_says_the_weights_changed(monkeypatch):
    monkeypatch.setattr(sglang_client, "UNFLUSHED_RETRY_S", 0.5)
    seen: list[dict] = []
    server = _serve([(400, REFUSED)], seen)
    try:
        with pytest.raises(
            RolloutError, match="were loaded but the cache of the old ones could not be flushed"
        ) as e:
            asyncio.run(_reload(f"http://127.0.0.1:{server.server_port}", "v2"))
    finally:
        server.shutdown()
    assert not isinstance(e.value, WeightsDirError) and len(seen) >= 2


def test_another_refusal_still_keeps_the_old_weights():
    seen: list[dict] = []
    server = _serve(
        [(400, {"success": False, "message": "Failed to get weights iterator: no such path"})], seen
    )
    try:
        with pytest.raises(WeightsDirError, match="keeps the old weights"):
            asyncio.run(_reload(f"http://127.0.0.1:{server.server_port}", "v2"))
    finally:
        server.shutdown()
    assert len(seen) == 1
