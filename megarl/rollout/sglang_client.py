"""Client of an SGLang server's native API (token ids in, token ids + logprobs out).

Routes: ``/generate`` (generation key), ``/update_weights_from_disk``, ``/pause_generation``,
``/continue_generation``, ``/abort_request``, ``/flush_cache`` (admin key), ``/health`` (open).
Behaviour measured on SGLang 0.5.23 that shapes this client (see megarl/testing/data/README.md):

- an out-of-vocabulary prompt id kills the whole server, so ids are checked here first;
- an aborted request (``/abort_request`` or ``/pause_generation`` mode "abort") still answers
  HTTP 200 with partial output; only ``finish_reason.type == "abort"`` says so;
- a failed ``/update_weights_from_disk`` answers 400 ``success: false`` and keeps the old weights;
- ``/generate`` answers one object for n=1 and a list for n>1;
- with ``sampling_params.n > 1`` the server gives each sample a random id of its own, so aborting the
  request's id stops nothing (measured live: an n=2 request ran to its end). n>1 is therefore sent
  as a batch of n copies of the prompt with one id per sample, and ``abort`` aborts every sample's id;
- ``/abort_request {rid}`` aborts every request whose id STARTS with ``rid`` (measured live:
  aborting "p-1" cut "p-10"), so the ids sent are ``<request id>#<i>``, never a prefix of another
  request's (the engine's own request ids are "megarl-<pid>-<counter>");
- the per-request seed is ignored unless the server runs with --enable-deterministic-inference.
"""

from __future__ import annotations

import os
from typing import Any

from megarl.rollout.http_base import HttpEngine
from megarl.rollout.types import (
    BadRequestError,
    GenerateRequest,
    GenerateResult,
    RolloutError,
    Sample,
    WeightsDirError,
)
from megarl.rollout.weights import check_weights_dir


class SGLangEngine(HttpEngine):
    """``RolloutEngine`` over one SGLang server.

    Args:
      return_logprob: ask for the sampled tokens' logprobs (RL needs them; ``Sample.logprobs`` is
        empty when False).
      logprob_start_len / top_logprobs_num: also return prompt logprobs from that position / the
        top-k alternatives (kept in ``Sample.meta``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        return_logprob: bool = True,
        logprob_start_len: int | None = None,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        reference_weights_dir: str | os.PathLike | None = None,
        **kw: Any,
    ):
        kw.setdefault("name", f"sglang@{base_url.split('://')[-1].rstrip('/')}")
        super().__init__(base_url, **kw)
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.return_text_in_logprobs = return_text_in_logprobs
        self._reference_names = (
            check_weights_dir(reference_weights_dir) if reference_weights_dir is not None else None
        )
        self._sample_rids: dict[str, list[str]] = {}  # request id -> the ids the server knows

    @staticmethod
    def sample_rids(request_id: str, n: int) -> list[str]:
        """The server-side ids of a request's samples, ``<request_id>#<i>``: the terminator keeps
        one request's ids from being a prefix of another's ("p-1#0" is no prefix of "p-10#0")."""
        return [f"{request_id}#{i}" for i in range(n)]

    def generate_body(self, req: GenerateRequest) -> dict:
        """The JSON body of ``/generate`` for one request."""
        sp = req.sampling
        params: dict[str, Any] = {
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "max_new_tokens": sp.max_new_tokens,
        }
        if sp.top_k != -1:
            params["top_k"] = sp.top_k
        if sp.stop_token_ids:
            params["stop_token_ids"] = list(sp.stop_token_ids)
        if sp.stop_strings:
            params["stop"] = list(sp.stop_strings)
        if sp.ignore_eos:
            params["ignore_eos"] = True
        body: dict[str, Any]
        if req.n == 1:
            if sp.seed is not None:
                params["sampling_seed"] = sp.seed
            body = {
                "input_ids": list(req.prompt_ids),
                "sampling_params": params,
                "rid": self.sample_rids(str(req.request_id), 1)[0],
            }
        else:
            # one batch entry per sample, each with an id of its own (see the module docstring);
            # sample i gets seed + i so that seeded samples differ from each other
            per_sample = [
                {**params, "sampling_seed": sp.seed + i} if sp.seed is not None else dict(params)
                for i in range(req.n)
            ]
            body = {
                "input_ids": [list(req.prompt_ids) for _ in range(req.n)],
                "sampling_params": per_sample,
                "rid": self.sample_rids(str(req.request_id), req.n),
            }
        if self.return_logprob:
            body["return_logprob"] = True
            if self.logprob_start_len is not None:
                body["logprob_start_len"] = self.logprob_start_len
            if self.top_logprobs_num:
                body["top_logprobs_num"] = self.top_logprobs_num
            if self.return_text_in_logprobs:
                body["return_text_in_logprobs"] = True
        if req.return_routed_experts:
            body["return_routed_experts"] = True
        return body

    def _parse_one(self, out: dict) -> Sample:
        meta = out.get("meta_info") or {}
        ids = [int(t) for t in out["output_ids"]]
        logprobs: list[float] = []
        if self.return_logprob:
            triples = meta.get("output_token_logprobs")
            if triples is None:
                raise RolloutError(
                    f"{self.name}: asked for logprobs but the response has no output_token_logprobs"
                )
            if [int(t[1]) for t in triples] != ids:
                raise RolloutError(f"{self.name}: output_token_logprobs token ids differ from output_ids")
            logprobs = [float(t[0]) for t in triples]
        fr = meta.get("finish_reason") or {}
        kind = fr.get("type") if isinstance(fr, dict) else str(fr)
        stop_reason = fr.get("matched") if isinstance(fr, dict) else None
        extras = {
            k: meta[k]
            for k in (
                "input_token_logprobs",
                "output_top_logprobs",
                "input_top_logprobs",
                "id",
                "cached_tokens",
            )
            if k in meta
        }
        return Sample(
            token_ids=ids,
            logprobs=logprobs,
            finish_reason=str(kind),
            weight_version=meta.get("weight_version"),
            stop_reason=stop_reason,
            routed_experts=meta.get("routed_experts"),
            meta=extras,
        )

    async def _generate(self, req: GenerateRequest) -> GenerateResult:
        rid = str(req.request_id)
        self._sample_rids[rid] = self.sample_rids(rid, req.n)
        try:
            body = await self.request("POST", "/generate", json_body=self.generate_body(req))
        finally:
            self._sample_rids.pop(rid, None)
        outs = body if isinstance(body, list) else [body]
        try:
            samples = [self._parse_one(o) for o in outs]
        except (KeyError, TypeError, IndexError) as e:
            raise RolloutError(
                f"{self.name}: unexpected /generate response ({type(e).__name__}: {e}): {str(body)[:300]}"
            ) from e
        if len(samples) != req.n:
            raise RolloutError(f"{self.name}: asked for n={req.n} samples, got {len(samples)}")
        return GenerateResult(
            prompt_ids=list(req.prompt_ids), samples=samples, engine=self.name, request_id=req.request_id
        )

    async def _score(self, ids: list[int], top_k: int):
        from megarl.rollout.scoring import parse_sglang_scores, sglang_score_body

        body = await self.request("POST", "/generate", json_body=sglang_score_body(ids, top_k))
        return parse_sglang_scores(self.name, body, ids, top_k)

    # ----------------------------------------------------------------------------- control
    async def update_weights(
        self,
        weights_dir: str | os.PathLike,
        version: str | None = None,
        *,
        flush_cache: bool = True,
        check_dir: bool = True,
    ) -> None:
        """Reload weights from a directory on the server's disk. SGLang keeps serving the old
        weights when the reload fails, so a failure raises ``WeightsDirError`` and the engine stays up.
        ``check_dir=False`` skips the local check (the directory is on another node)."""
        path = str(weights_dir)
        if check_dir:
            path = os.path.abspath(path)
            check_weights_dir(path, self._reference_names)
        body: dict[str, Any] = {"model_path": path}
        if version is not None:
            body["weight_version"] = version
        if not flush_cache:
            body["flush_cache"] = False
        try:
            out = await self.request("POST", "/update_weights_from_disk", json_body=body, admin=True)
        except BadRequestError as e:
            raise WeightsDirError(
                f"{self.name}: server refused the weights at {path}; it keeps the old weights ({e})"
            ) from e
        if not (isinstance(out, dict) and out.get("success")):
            raise WeightsDirError(f"{self.name}: weight update from {path} failed: {out}")
        if version is not None:
            self.weight_version = version

    async def pause(self, mode: str = "abort") -> None:
        """``/pause_generation``: "abort" ends in-flight requests (they return partial output with
        finish_reason "abort"), "in_place" freezes them until ``resume``. New requests wait client-side."""
        await super().pause()
        await self.request("POST", "/pause_generation", json_body={"mode": mode}, admin=True)

    async def resume(self) -> None:
        """``/continue_generation`` and release held requests."""
        await self.request("POST", "/continue_generation", json_body={}, admin=True)
        await super().resume()

    async def abort(self, request_id: str | None = None) -> int:
        """``/abort_request`` for every sample of one request (or of every in-flight one); the
        callers get their partial output with finish_reason "abort" from the server. Returns the
        number of requests aborted."""
        ids = [request_id] if request_id is not None else list(self._inflight)
        for rid in ids:
            # not in flight here: "<rid>#" still reaches its samples on the server, and nothing else
            for sample_rid in self._sample_rids.get(rid, [f"{rid}#"]):
                await self.request("POST", "/abort_request", json_body={"rid": sample_rid}, admin=True)
        return len(ids)

    async def flush_cache(self) -> bool:
        """``/flush_cache``; False when the server refuses (requests running or paused in place)."""
        try:
            await self.request("POST", "/flush_cache", admin=True, expect_json=False)
            return True
        except BadRequestError:
            return False

    async def health(self, generate: bool = False) -> bool:
        """``/health`` (or ``/health_generate``, which runs a one-token generation)."""
        if self.dead_reason is not None:
            return False
        try:
            await self.request(
                "GET",
                "/health_generate" if generate else "/health",
                expect_json=False,
                admin=False,
                timeout_s=30.0,
            )
            return True
        except RolloutError:
            return False

    async def model_info(self) -> dict:
        """``/get_model_info`` (model path, weight_version, ...)."""
        return await self.request("GET", "/get_model_info")

    async def server_info(self) -> dict:
        """``/get_server_info`` (server args and internal state)."""
        return await self.request("GET", "/get_server_info")
