"""``teacher.source: engine``: the teacher's logprobs of the batch's tokens from a rollout engine
that serves the teacher (vLLM ``prompt_logprobs``, SGLang input logprobs, or the embedded engine on
``teacher.hf_dir``), instead of a forward-only Megatron teacher beside the learner.

Rank 0 sends every sequence of the batch (prompt + response token ids, exactly the student's
tokens) to the teacher's servers, spread round-robin over ``teacher.urls``, and broadcasts the
``[T]`` logprobs to every rank (every rank holds the same whole batch when learner inputs are
filled). No teacher weights live in the learner's memory: the teacher may be any model the engine
serves with the policy's vocabulary (a large MoE served with its own parallelism, for instance).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
import torch.distributed as dist

from megarl.batch import PackedBatch
from megarl.plugin.teacher_config import teacher_config
from megarl.plugin.teacher_pass import check_rows, selected_rows, token_index


def teacher_engines(t: Any) -> list:
    """The engines of the ``teacher`` section ``t`` (rank 0 only): one client per ``t.urls`` entry
    (vLLM or SGLang, with the keys of ``t.key_file`` when set), or the embedded engine on
    ``t.hf_dir``."""
    if t.engine == "embedded":
        from megarl.rollout.embedded import EmbeddedEngine

        if not t.hf_dir:
            raise ValueError("teacher.engine=embedded needs teacher.hf_dir (the teacher's HF checkpoint)")

        return [EmbeddedEngine.from_pretrained(t.hf_dir, name="teacher-embedded")]
    from megarl.rollout.keys import RolloutKeys

    kw: dict[str, Any] = {"max_concurrency": t.max_concurrency}
    if t.key_file:
        keys = RolloutKeys.read(t.key_file)
        kw.update(api_key=keys.api_key, admin_key=keys.admin_key)
    if t.engine == "vllm":
        from megarl.rollout.vllm_client import VLLMEngine

        return [VLLMEngine(u, t.model, name=f"teacher-vllm@{u}", **kw) for u in t.urls]
    from megarl.rollout.sglang_client import SGLangEngine

    return [SGLangEngine(u, name=f"teacher-sglang@{u}", **kw) for u in t.urls]


async def score_sequences(engines: list, seqs: list[list[int]], top_k: int = 0) -> list:
    """``TokenScores`` of every sequence, sequence ``i`` on engine ``i % len(engines)`` (each
    engine bounds its own requests in flight)."""
    return await asyncio.gather(
        *(engines[i % len(engines)].score_tokens(s, top_k) for i, s in enumerate(seqs))
    )


class EngineTeacherPass:
    """Fills ``teacher_logprobs`` [T] and, when asked (``top_k`` > 0), ``teacher_topk``
    (``token_extras["teacher_topk_ids"/"teacher_topk_logprobs"]`` [T, K]; rows of first tokens
    are -1 / -inf) from engines serving the teacher: rank 0 asks, every rank receives.

    ``engines``: rank 0's teacher engines (None on the other ranks); ``device``: where the
    broadcast runs (the process group's device: cuda under NCCL)."""

    def __init__(self, engines: list | None, device: Any = "cpu", top_k: int = 0, rows: str = ""):
        self.engines, self.device, self.top_k, self.rows = engines, device, top_k, rows
        self.loop = asyncio.new_event_loop() if engines else None

    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """In place (collective over the world); with ``rows`` only the selected sequences are sent
        (the others get logprob 0)."""
        T, K = batch.num_tokens, self.top_k
        lp = torch.zeros(T, 1 + 2 * K, dtype=torch.float64)  # logprob, K ids, K logprobs
        chosen = selected_rows(batch, self.rows)
        which = list(range(batch.num_seqs)) if chosen is None else chosen
        if self.engines and which:
            cu = batch.cu_seqlens.tolist()
            toks = batch.tokens.tolist()
            seqs = [toks[cu[i] : cu[i + 1]] for i in which]
            scores = self.loop.run_until_complete(score_sequences(self.engines, seqs, K))
            idx = token_index(batch, which)
            lp[idx, 0] = torch.tensor([x for s in scores for x in s.logprobs], dtype=torch.float64)
            if K:
                lp[idx, 1:] = _topk_rows(scores, K)
        if dist.is_initialized() and dist.get_world_size() > 1:
            lp = lp.to(self.device)
            dist.broadcast(lp, src=0)
        lp = lp.cpu()
        batch.teacher_logprobs = lp[:, 0].float()
        if K:
            batch.token_extras["teacher_topk_ids"] = lp[:, 1 : 1 + K].long()
            batch.token_extras["teacher_topk_logprobs"] = lp[:, 1 + K :].float()
        if chosen is not None:
            return {"teacher/forwarded_frac": len(chosen) / max(1, batch.num_seqs)}
        return {}

    def close(self) -> None:
        """Close the clients and the private event loop (rank 0)."""
        if self.engines:
            for e in self.engines:
                self.loop.run_until_complete(e.close())
            self.loop.close()
            self.engines = None


def _topk_rows(scores: list, k: int) -> torch.Tensor:
    """[T, 2k]: per token the k ids then the k logprobs (positions with fewer: id -1, -inf)."""
    rows = []
    for s in scores:
        for ids, lps in zip(s.top_ids, s.top_logprobs):
            pad = k - len(ids)
            rows.append(list(ids) + [-1] * pad + list(lps) + [float("-inf")] * pad)
    return torch.tensor(rows, dtype=torch.float64)


def build_engine_teacher(ctx: Any, names: frozenset = frozenset(), top_k: int = 8) -> EngineTeacherPass:
    """The pass for the run's ``teacher`` section (``source: engine``) filling ``names``; engines are made on
    rank 0 only. The full logits are the Megatron teacher's alone."""
    if "teacher_logits" in names:
        raise ValueError(
            "teacher.source=engine gives the teacher's logprobs and top-K, not its full-vocabulary "
            "logits (needed by the full-vocabulary objective.distill modes); use teacher.source=megatron"
        )
    rows = getattr(ctx.knobs, "rows", "")
    check_rows(rows, names)
    device = ctx.groups.device if ctx.groups is not None else "cpu"
    k = top_k if "teacher_topk" in names else 0
    return EngineTeacherPass(teacher_engines(teacher_config(ctx.cfg)) if ctx.rank0 else None, device, k, rows)
