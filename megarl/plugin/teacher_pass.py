"""The teacher's batch inputs from a forward-only Megatron teacher (``teacher.source: megatron``).

- ``teacher_logprobs`` [T]: the teacher's logprob of every token (every rank);
- ``teacher_logits``: ``token_extras["teacher_logits"]`` [T, V/tp], this rank's vocab shard of the
  teacher's aligned logits (the last pipeline stage only; the same sharding as the student's
  logits, since both share the vocabulary and the layout); the full-vocabulary distillation
  modes read them as ``LossContext.teacher_logits``. Memory: T·V/tp values per last-stage rank;
- ``teacher_topk``: ``token_extras["teacher_topk_ids"]`` [T, K] (int64, global ids, best first)
  and ``["teacher_topk_logprobs"]`` [T, K] (last stage), from a vocab-parallel top-K (local top-K,
  all-gather of TP·K candidates, top-K again) and the global log-normaliser; K is
  ``inputs.teacher_topk.top_k``.

A teacher served by an engine (megarl/plugin/engine_teacher.py) fills ``teacher_logprobs`` and
``teacher_topk`` (the engine's top-K logprobs), not ``teacher_logits``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.plugin.knobs import Knobs


@dataclass
class TeacherKnobs(Knobs):
    """``top_k``: how many of the teacher's best tokens ``teacher_topk`` keeps per position."""

    top_k: int = 8

    def check(self) -> None:
        """``top_k`` >= 1."""
        if self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1")


def topk_logprobs(logits: torch.Tensor, k: int, tp_group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k], logprobs [T, k]) of the k most likely tokens of vocab-parallel ``logits``."""
    from megarl.ops.vocab_parallel import vocab_parallel_logsumexp, vocab_parallel_topk

    vals, ids = vocab_parallel_topk(logits, k, tp_group)
    lse = vocab_parallel_logsumexp(logits.float(), tp_group)
    return ids, vals.float() - lse.unsqueeze(-1)


class MegatronTeacherPass:
    """Fills the requested teacher inputs (``names``) with forward passes of a teacher learner."""

    def __init__(self, learner: Any, names: frozenset, top_k: int = 8):
        self.learner, self.names, self.top_k = learner, names, top_k

    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """In place (collective)."""
        if "teacher_logprobs" in self.names:
            batch.teacher_logprobs, _ = self.learner.compute_logprobs(batch, micro_batches)
        if not self.names & {"teacher_logits", "teacher_topk"}:
            return {}
        logits = self.learner.compute_logits(batch, micro_batches)
        if logits is None:  # not the last pipeline stage: the loss never runs here
            return {}
        g = self.learner.groups
        tp_group = g.tp if g.layout.tp > 1 else None
        if "teacher_topk" in self.names:
            ids, lp = topk_logprobs(logits, self.top_k, tp_group)
            batch.token_extras["teacher_topk_ids"] = ids.cpu()
            batch.token_extras["teacher_topk_logprobs"] = lp.cpu()
        if "teacher_logits" in self.names:
            batch.token_extras["teacher_logits"] = logits
        return {}
