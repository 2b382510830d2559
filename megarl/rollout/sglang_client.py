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

import asyncio
import os
import time
from collections.abc import Iterable
from typing import Any

from megarl.rollout.http_base import HttpEngine
from megarl.rollout.types import (
    BadRequestError,
    EngineDeadError,
    GenerateRequest,
    GenerateResult,
    RolloutError,
    Sample,
    WeightsDirError,
    check_weight_sync_backend,
)
from megarl.rollout.weights import check_weights_dir

# SGLang's answer when a reload from disk succeeded but its cache flush was refused because a request
# still ran; it comes right after a generate returns (the scheduler retires the request a moment later)
UNFLUSHED = "Weights were updated, but the cache was not flushed"
UNFLUSHED_RETRY_S = 30.0


class SGLangEngine(HttpEngine):
    """``RolloutEngine`` over one SGLang server.

    Args:
      return_logprob: ask for the sampled tokens' logprobs (RL needs them; ``Sample.logprobs`` is
        empty when False).
      logprob_start_len / top_logprobs_num: also return prompt logprobs from that position / the
        top-k alternatives (kept in ``Sample.meta``).
      weight_sync_backend: the in-memory sync's backend; None (the default) follows the server's
        device: gloo for a CPU server, NCCL for a CUDA one on other GPUs than this process's, gloo
        for one on this process's GPU (``memory_sync.choose_backend``).
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
        weight_sync_backend: str | None = None,
        **kw: Any,
    ):
        kw.setdefault("name", f"sglang@{base_url.split('://')[-1].rstrip('/')}")
        super().__init__(base_url, **kw)
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.weight_sync_backend = check_weight_sync_backend(weight_sync_backend)
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
        A reload whose cache flush SGLang refused (a request it had just answered still counted as
        running) changed the weights but not the version label: the cache is flushed (asking again
        for up to ``UNFLUSHED_RETRY_S``; then ``RolloutError``, not ``WeightsDirError``) and the
        label set, without loading the weights again.
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
            if UNFLUSHED not in str(e):
                raise WeightsDirError(
                    f"{self.name}: server refused the weights at {path}; it keeps the old weights ({e})"
                ) from e
            # the weights loaded, but a request the server had just answered still counted as
            # running, so the flush was refused and the version label left as it was: do both now
            try:
                await self._flush_and_label(version, UNFLUSHED_RETRY_S)
            except RolloutError as flush_error:
                raise RolloutError(
                    f"{self.name}: the weights at {path} were loaded, but {flush_error} ({e})"
                ) from e
            return
        if not (isinstance(out, dict) and out.get("success")):
            raise WeightsDirError(f"{self.name}: weight update from {path} failed: {out}")
        if version is not None:
            self.weight_version = version

    async def update_weights_from_tensors(self, state: dict, version: str | None = None) -> None:
        """Send the HF-named tensors ``state`` to the server in memory; see ``update_weights_streamed``."""
        from megarl.rollout.memory_sync import plan_buckets

        await self.update_weights_streamed(list(state), plan_buckets(state), version)

    async def update_weights_streamed(
        self, names: list[str], buckets: Iterable[dict], version: str | None = None
    ) -> None:
        """Stream ``buckets`` (dicts of HF-named tensors, consumed once, e.g. straight from the
        learner's gather) into the server over a torch.distributed group (megarl/rollout/sglang_sync.py):
        one ``/update_weights_from_distributed`` call per bucket while its tensors are broadcast.
        New requests wait client-side and the ones in flight finish first. ``names``: every tensor
        the buckets will hold.

        Raises ``WeightsDirError`` naming the tensors (nothing sent) when ``names`` differ from the
        served model's. A failure before the first bucket reached the server leaves it on its old
        weights and version (the error is re-raised); a failure after that (weights partly new,
        group broken, server gone) marks the engine dead and raises ``EngineDeadError``.
        """
        if self._reference_names is not None:
            missing = sorted(self._reference_names - set(names))
            unknown = sorted(set(names) - self._reference_names)
            if missing or unknown:
                raise WeightsDirError(
                    f"{self.name}: in-memory weights do not match the served model: "
                    f"missing {missing[:5]}, unknown {unknown[:5]}"
                )
        await HttpEngine.pause(self)  # new requests wait here
        sent = 0  # buckets whose transfer started: from the first one on, the weights may be mixed
        try:
            while self._inflight:
                await asyncio.sleep(0.05)
            channel = await self._weight_channel()
            digests = self._digests()
            await self._control("/begin_weight_update", {})
            it = iter(buckets)
            try:
                while (bucket := await asyncio.to_thread(next, it, None)) is not None:
                    sent += 1
                    await self._sync_bucket(channel, bucket, digests)
            finally:
                await self._control("/end_weight_update", {})
            if digests is not None:
                await self._verify(digests)
            await self._flush_and_label(version)
        except Exception as e:
            if sent == 0 and self.dead_reason is None and not isinstance(e, EngineDeadError):
                raise  # nothing reached the server: it serves the old weights
            why = f"in-memory weight sync failed after {sent} bucket(s) started"
            self.mark_dead(f"{why}: {e}")
            raise EngineDeadError(f"{self.name}: {why}; the server must be restarted ({e})") from e
        finally:
            await HttpEngine.resume(self)

    async def _flush_and_label(self, version: str | None, wait_s: float = 30.0) -> None:
        """After new weights: drop the cache the old ones computed (SGLang refuses while requests,
        another client's, still run, so ask again for ``wait_s``), then label the server ``version``."""
        if not await self.flush_cache(wait_s):
            raise RolloutError(f"the cache of the old weights could not be flushed in {wait_s:.0f} s")
        if version is not None:
            body = {"new_version": version, "abort_all_requests": False}
            await self._control("/update_weight_version", body)
            self.weight_version = version

    async def _control(self, path: str, body: dict, timeout_s: float = 3600.0) -> dict:
        """One admin call that answers ``{"success": ..., "message": ...}``; raises on failure."""
        out = await self.request("POST", path, json_body=body, admin=True, timeout_s=timeout_s)
        if isinstance(out, dict) and out.get("success") is False:
            raise RolloutError(f"{self.name}: {path} failed: {out.get('message')}")
        return out

    async def _sync_bucket(self, channel, bucket: dict, digests) -> None:
        """Announce one bucket and broadcast its tensors at the same time."""

        from megarl.rollout.sglang_sync import bucket_meta

        body = {**bucket_meta(bucket), "group_name": channel.group_name, "flush_cache": False}
        await _together(
            self._control("/update_weights_from_distributed", body),
            asyncio.to_thread(channel.send_bucket, bucket, digests),
        )

    def _digests(self):
        """What to check after a sync: SGLang's CPU engine hashes each parameter with SHA-256
        (``/weights_checker``), which the trainer can recompute; its GPU hash and sharded (TP > 1)
        parameters cannot be, so those syncs rely on the transfer alone."""
        import torch

        from megarl.rollout.sglang_sync import EngineDigests

        info = self._sync_info
        dtype = getattr(torch, str(info.get("dtype")), None)
        if (
            info.get("device") != "cpu"
            or int(info.get("tp_size", 1)) != 1
            or not isinstance(dtype, torch.dtype)
        ):
            return None
        return EngineDigests(dtype)

    async def _verify(self, digests) -> None:
        """Compare SGLang's checksum of every parameter the sync wrote with the trainer's (a
        parameter only one side names, e.g. of a layout not in ``sglang_sync.FUSED``, is not
        checked; ``last_sync_check`` says how many were)."""
        out = await self._control("/weights_checker", {"action": "checksum"})
        engine: dict[str, str] = {}
        for rank in out.get("ranks") or []:
            engine.update(rank.get("checksums") or {})
        checked, differ = digests.compare(engine)
        self.last_sync_check = {"checked": checked, "sent": len(digests.digests), "differ": differ}
        if differ:
            raise RolloutError(
                f"checksums after the sync differ from the trainer's for {len(differ)} of {checked} "
                f"parameters ({differ[:5]})"
            )

    async def _weight_channel(self):
        """The group with this server's ranks, opened on first use (backend by the server's device)."""

        from megarl.rollout.memory_sync import channel_host, choose_backend, sglang_workers
        from megarl.rollout.sglang_sync import GroupChannel

        if getattr(self, "_channel", None) is not None:
            return self._channel
        info = await self.server_info()
        if int(info.get("pp_size", 1)) > 1 or int(info.get("dp_size", 1)) > 1:
            raise RolloutError(
                f"{self.name}: SGLang receives weights in memory with tensor parallelism only "
                f"(pp_size={info.get('pp_size')}, dp_size={info.get('dp_size')}); "
                "use rollout.weight_sync: disk"
            )
        self._sync_info = info
        workers = sglang_workers(info, self.base_url)
        backend = choose_backend(workers, self.name, self.weight_sync_backend)
        channel = GroupChannel.host_store(
            channel_host(self.base_url), 1 + int(info.get("tp_size", 1)), backend=backend
        )
        try:
            await _together(
                self._control("/init_weights_update_group", channel.invitation()),
                asyncio.to_thread(channel.join),
            )
        except Exception as e:
            raise RolloutError(f"{self.name}: could not open the weight-sync group: {e}") from e
        self._channel = channel
        return channel

    async def close(self) -> None:
        """Leave the weight-sync group (SGLang keeps a group until told) and close the client."""
        channel = getattr(self, "_channel", None)
        if channel is not None and self.dead_reason is None:
            self._channel = None
            try:
                body = {"group_name": channel.group_name}
                await self.request("POST", "/destroy_weights_update_group", json_body=body, admin=True)
            except RolloutError:
                pass  # the server is gone or busy: its group goes with it
        await super().close()

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

    async def flush_cache(self, wait_s: float = 0.0) -> bool:
        """``/flush_cache``; False when the server refuses (requests running or paused in place),
        after asking again for ``wait_s`` (SGLang answers a request's last tokens before its
        scheduler retires it, so a flush right after a generate can be refused for a moment)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                await self.request("POST", "/flush_cache", admin=True, expect_json=False)
                return True
            except BadRequestError:
                if time.monotonic() >= deadline:
                    return False
            await asyncio.sleep(0.1)

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


async def _together(call, transfer) -> None:
    """Run an HTTP call and the matching group transfer together. If one fails the other is not
    awaited: the transfer's thread waits for its peer until the group's timeout, and its error,
    if any, is dropped."""
    tasks = [asyncio.ensure_future(call), asyncio.ensure_future(transfer)]
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for t in tasks:
        if not t.done():
            t.add_done_callback(lambda t: t.cancelled() or t.exception())
    for t in done:
        if t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
