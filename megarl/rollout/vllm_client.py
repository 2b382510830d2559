"""Client of a vLLM OpenAI-compatible server (token ids in, token ids + logprobs out).

Generation: ``POST /v1/completions`` with the prompt as token ids, ``return_token_ids`` and
``logprobs=0`` (the sampled token's logprob only). Weight reload (server started with
``VLLM_SERVER_DEV_MODE=1``): ``/pause?mode=wait`` -> ``/collective_rpc reload_weights`` ->
``/reset_prefix_cache`` -> ``/update_weight_version`` -> ``/resume``. The directory is checked
before the reload is asked for, because a failed reload leaves vLLM's engine dead (measured:
the next request crashes the worker while ``/health`` still answers 200); a failed reload
therefore marks this server dead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from megarl.rollout.http_base import HttpEngine
from megarl.rollout.types import (
    EngineDeadError,
    GenerateRequest,
    GenerateResult,
    RolloutError,
    Sample,
    check_weight_sync_backend,
)
from megarl.rollout.weights import check_weights_dir


def decode_routed_experts(payload: str | None):
    """vLLM's ``routed_experts`` (base64 of a ``.npy``; servers started with
    ``--enable-return-routed-experts``) -> int64 tensor [P+R-1, moe_layers, topk], or None.
    The last sampled token was never forwarded, so it has no routing row."""
    if payload is None:
        return None
    import base64
    import io

    import numpy as np
    import torch

    arr = np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)
    return torch.from_numpy(arr.astype(np.int64))


class VLLMEngine(HttpEngine):
    """``RolloutEngine`` over one vLLM server.

    Args:
      base_url: e.g. ``http://127.0.0.1:8000`` (or the authenticating forwarder's address).
      model: the ``--served-model-name``.
      reference_weights_dir: a checkpoint of the served model; its tensor names are what a new
        weights directory must contain (checked before every reload).
      weight_sync_backend: the in-memory sync's backend; None (the default) follows the server's
        workers' device: gloo for CPU workers, NCCL for CUDA ones on other GPUs than this
        process's, gloo for a server on this process's GPU (``memory_sync.choose_backend``).

    Routed experts (MoE replay) come back in ``Sample.routed_experts`` when the server was started
    with ``--enable-return-routed-experts`` (a server-wide switch in vLLM 0.32, not per request).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        reference_weights_dir: str | os.PathLike | None = None,
        weight_sync_backend: str | None = None,
        **kw: Any,
    ):
        kw.setdefault("name", f"vllm@{base_url.split('://')[-1].rstrip('/')}")
        super().__init__(base_url, **kw)
        self.model = model
        self.weight_sync_backend = check_weight_sync_backend(weight_sync_backend)
        self._channel_plan_cache: tuple[int, str] | None = None
        self._reference_names = (
            check_weights_dir(reference_weights_dir) if reference_weights_dir is not None else None
        )

    def _completion_body(self, req: GenerateRequest) -> dict:
        sp = req.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(req.prompt_ids),
            "n": req.n,
            "max_tokens": sp.max_new_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "ignore_eos": sp.ignore_eos,
        }
        if sp.top_k != -1:
            body["top_k"] = sp.top_k
        if sp.seed is not None:
            body["seed"] = sp.seed
        if sp.stop_token_ids:
            body["stop_token_ids"] = list(sp.stop_token_ids)
        if sp.stop_strings:
            body["stop"] = list(sp.stop_strings)
            body["include_stop_str_in_output"] = True
        return body

    async def _generate(self, req: GenerateRequest) -> GenerateResult:
        body = await self.request(
            "POST",
            "/v1/completions",
            json_body=self._completion_body(req),
            headers={"X-Request-Id": req.request_id},
        )
        try:
            choices = sorted(body["choices"], key=lambda c: c["index"])
            samples = []
            for c in choices:
                ids = [int(t) for t in c["token_ids"]]
                lp = c.get("logprobs") or {}
                logprobs = [float(x) for x in (lp.get("token_logprobs") or [])]
                if len(logprobs) != len(ids):
                    raise RolloutError(
                        f"{self.name}: choice {c['index']} has {len(ids)} token ids but "
                        f"{len(logprobs)} logprobs"
                    )
                samples.append(
                    Sample(
                        token_ids=ids,
                        logprobs=logprobs,
                        finish_reason=str(c["finish_reason"]),
                        stop_reason=c.get("stop_reason"),
                        routed_experts=decode_routed_experts(c.get("routed_experts")),
                    )
                )
        except (KeyError, TypeError) as e:
            raise RolloutError(
                f"{self.name}: unexpected /v1/completions response (missing {e}): {str(body)[:300]}"
            ) from e
        if len(samples) != req.n:
            raise RolloutError(f"{self.name}: asked for n={req.n} samples, got {len(samples)}")
        return GenerateResult(
            prompt_ids=list(req.prompt_ids), samples=samples, engine=self.name, request_id=req.request_id
        )

    async def _score(self, ids: list[int], top_k: int):
        from megarl.rollout.scoring import parse_vllm_scores, vllm_score_body

        body = await self.request(
            "POST", "/v1/completions", json_body=vllm_score_body(self.model, ids, top_k)
        )
        return parse_vllm_scores(self.name, body, ids, top_k)

    async def update_weights(self, weights_dir: str | os.PathLike, version: str | None = None) -> None:
        """Reload all weights from ``weights_dir`` while serving; in-flight requests finish first.

        Raises ``WeightsDirError`` (nothing sent, server untouched) for a bad directory and
        ``EngineDeadError`` (server marked dead) when the server fails the reload.
        """
        weights_dir = os.path.abspath(weights_dir)
        check_weights_dir(weights_dir, self._reference_names)
        await super().pause()  # hold new requests client-side while the server drains
        try:
            await self.request("POST", "/pause", params={"mode": "wait"}, admin=True)
            await self._reload(weights_dir)
            await self.request("POST", "/reset_prefix_cache", admin=True)
            await self._set_version(version)
            await self.request("POST", "/resume", admin=True)
        finally:
            await super().resume()

    async def update_weights_keeping_requests(
        self, weights_dir: str | os.PathLike, version: str | None, on_frozen: Callable[[list[str]], None]
    ) -> None:
        """Reload all weights while the in-flight requests stay on the server, frozen, and then finish
        with the new weights (the async loop's ``partial_rollout: continue``). ``on_frozen`` gets the
        ids of those requests once no new request can start: their tokens come from both versions.
        Errors as for ``update_weights``.
        """
        weights_dir = os.path.abspath(weights_dir)
        check_weights_dir(weights_dir, self._reference_names)
        await super().pause()  # requests not yet sent wait client-side
        try:
            on_frozen(list(self._inflight))
            await self.request("POST", "/pause", params={"mode": "keep"}, admin=True)
            await self._reload(weights_dir)
            await self._set_version(version)
            await self.request("POST", "/resume", admin=True)
        finally:
            await super().resume()

    async def update_weights_from_tensors(self, state: dict, version: str | None = None) -> None:
        """Send the HF-named tensors ``state`` to the server in memory; see ``update_weights_streamed``."""
        from megarl.rollout.memory_sync import plan_buckets

        await self.update_weights_streamed(list(state), plan_buckets(state), version)

    async def update_weights_streamed(
        self, names: list[str], buckets: Iterable[dict], version: str | None = None
    ) -> None:
        """Stream ``buckets`` (dicts of HF-named tensors, consumed once, e.g. straight from the
        learner's gather) to the server's workers, which reload them in place while serving;
        in-flight requests finish first. ``names``: every tensor the buckets will hold.

        Needs a server started with megarl's weight receiver (``launch_vllm`` adds it). Raises
        ``WeightsDirError`` naming the tensors (nothing sent) when ``names`` differ from the served
        model's, and ``EngineDeadError`` (server marked dead) when the sync fails part-way or a
        bucket's CRC-32 on the server differs from the trainer's.
        """
        import asyncio

        from megarl.rollout.types import WeightsDirError

        if self._reference_names is not None:
            missing = sorted(self._reference_names - set(names))
            unknown = sorted(set(names) - self._reference_names)
            if missing or unknown:
                raise WeightsDirError(
                    f"{self.name}: in-memory weights do not match the served model: "
                    f"missing {missing[:5]}, unknown {unknown[:5]}"
                )
        await self._channel_plan()  # refusals (no receiver, NCCL without CUDA) before the pause
        await super().pause()
        try:
            await self.request("POST", "/pause", params={"mode": "wait"}, admin=True)
            channel = await self._weight_channel()
            receiving = asyncio.ensure_future(self._rpc("megarl_receive_weights"))
            sending = asyncio.ensure_future(asyncio.to_thread(channel.send, buckets))
            await asyncio.wait({receiving, sending}, return_when=asyncio.FIRST_EXCEPTION)
            if receiving.done() and receiving.exception() is not None and not sending.done():
                channel.cancel()  # the workers are gone: an NCCL send stops waiting on them
            received, sent = await asyncio.gather(receiving, sending, return_exceptions=True)
            failure = next((o for o in (sent, received) if isinstance(o, BaseException)), None)
            key = channel.checksum_key
            if failure is None and any(r.get(key) != sent for r in received):
                failure = RolloutError(f"bucket checksums ({key}) differ: sent {sent}, workers {received}")
            if failure is not None:
                self.mark_dead(f"in-memory weight sync failed: {failure}")
                raise EngineDeadError(
                    f"{self.name}: in-memory weight sync failed; the server must be restarted ({failure})"
                ) from failure
            await self.request("POST", "/reset_prefix_cache", admin=True)
            await self._set_version(version)
            await self.request("POST", "/resume", admin=True)
        finally:
            await super().resume()

    async def _rpc(self, method: str, **kwargs: str) -> list:
        body = await self.request(
            "POST",
            "/collective_rpc",
            admin=True,
            json_body={"method": method, "kwargs": kwargs},
            timeout_s=3600.0,
        )
        return list((body or {}).get("results", []))

    async def _channel_plan(self) -> tuple[int, str]:
        """(workers, backend) of this server's channel, asked once: the workers answer their device
        (``/collective_rpc megarl_worker_device``) and ``memory_sync.choose_backend`` picks from it
        and ``weight_sync_backend``. Raises ``RolloutError`` when the server has no receiver, or
        NCCL is needed and cannot run (no CUDA device here, CPU workers, a shared GPU)."""
        from megarl.rollout.memory_sync import choose_backend

        if self._channel_plan_cache is not None:
            return self._channel_plan_cache
        try:
            workers = await self._rpc("megarl_worker_device")
        except RolloutError as e:
            raise RolloutError(
                f"{self.name}: the server has no megarl weight receiver (start it with "
                "--worker-extension-cls megarl_vllm_receiver.MegarlWeightReceiver and "
                "megarl/rollout/vllm_ext on PYTHONPATH, as launch_vllm does) or use "
                f"rollout.weight_sync: disk ({e})"
            ) from e
        backend = choose_backend(workers, self.name, self.weight_sync_backend)
        self._channel_plan_cache = (len(workers), backend)
        return self._channel_plan_cache

    async def _weight_channel(self):
        """The channel to this server's workers, opened on first use."""
        import asyncio

        from megarl.rollout.memory_sync import WeightChannel, channel_host

        if getattr(self, "_channel", None) is not None:
            return self._channel
        workers, backend = await self._channel_plan()
        channel = WeightChannel.host_store(
            channel_host(str(self._client.base_url)), 1 + workers, backend=backend
        )
        await asyncio.gather(
            self._rpc("megarl_open_channel", channel=channel.invitation()), asyncio.to_thread(channel.join)
        )
        self._channel = channel
        return channel

    async def _reload(self, weights_dir: str) -> None:
        """The server reloads its weights from ``weights_dir``; a failure marks it dead."""
        try:
            await self.request(
                "POST",
                "/collective_rpc",
                admin=True,
                json_body={"method": "reload_weights", "kwargs": {"weights_path": weights_dir}},
            )
        except RolloutError as e:
            self.mark_dead(f"weight reload from {weights_dir} failed: {e}")
            raise EngineDeadError(
                f"{self.name}: weight reload from {weights_dir} failed; the server must be restarted ({e})"
            ) from e

    async def _set_version(self, version: str | None) -> None:
        if version is not None:
            await self.request(
                "POST", "/update_weight_version", admin=True, json_body={"new_version": version}
            )
            self.weight_version = version

    async def abort(self, request_id: str | None = None) -> int:
        """Abort one request (or all with ``None``): the caller gets finish_reason "abort" at once and
        the server drops the request (``/abort_requests``; a client disconnect alone does not reach
        vLLM through the forwarder)."""
        ids = [request_id] if request_id is not None else list(self._inflight)
        count = await super().abort(request_id)
        if ids:
            # vLLM names a completion's request "cmpl-<X-Request-Id>-<prompt index>".
            await self.request(
                "POST",
                "/abort_requests",
                admin=True,
                json_body={"request_ids": [f"cmpl-{rid}-0" for rid in ids]},
            )
        return count

    async def pause(self, mode: str = "wait") -> None:
        """Pause the server (``mode``: "wait" drains in-flight requests, "abort" ends them, "keep"
        freezes them) and hold new requests client-side."""
        await super().pause()
        await self.request("POST", "/pause", params={"mode": mode}, admin=True)

    async def resume(self) -> None:
        """Resume the server and release held requests."""
        await self.request("POST", "/resume", admin=True)
        await super().resume()

    async def health(self) -> bool:
        """``/health`` answers 200 and no failure marked this server dead (vLLM's /health stays 200
        for a while after a failed reload, so the mark matters)."""
        if self.dead_reason is not None:
            return False
        try:
            await self.request("GET", "/health", expect_json=False, timeout_s=10.0)
            return True
        except RolloutError:
            return False

    async def server_weight_version(self) -> str:
        """The version label the server reports (``/weight_info``)."""
        body = await self.request("GET", "/weight_info")
        return str(body["weight_version"])

    async def model_info(self) -> dict:
        """``/v1/models`` entry of the served model (``max_model_len`` etc.)."""
        body = await self.request("GET", "/v1/models")
        for m in body["data"]:
            if m["id"] == self.model:
                return m
        raise RolloutError(
            f"{self.name}: model {self.model!r} not served (served: {[m['id'] for m in body['data']]})"
        )
