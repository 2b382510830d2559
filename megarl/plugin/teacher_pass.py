"""The teacher's batch inputs from a forward-only Megatron teacher (``teacher.source: megatron``).

- ``teacher_logprobs`` [T]: the teacher's logprob of every token (every rank);
- ``teacher_logits``: ``token_extras["teacher_logits"]`` [T, V/tp], this rank's vocab shard of the
  teacher's aligned logits (the last pipeline stage only; the same sharding as the student's
  logits, since both share the vocabulary and the layout); the full-vocabulary distillation
  modes read them as ``LossContext.teacher_logits``. Memory: T·V/tp values per last-stage rank;
- ``teacher_topk``: ``token_extras["teacher_topk_ids"]`` [T, K] (int64, global ids, best first)
  and ``["teacher_topk_logprobs"]`` [T, K] (last stage), from a vocab-parallel top-K (local top-K,
  all-gather of TP·K candidates, top-K again) and the global log-normaliser; K is
  ``inputs.teacher_topk.top_k``. Without ``teacher_logits`` this is the learner's top-K pass
  (``Learner.compute_topk_logprobs``: with the fused output layer, no ``[T, V/tp]`` logits).

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
    """``top_k``: how many of the teacher's best tokens ``teacher_topk`` keeps per position;
    ``rows``: a key of ``batch.extras`` ([B], set before the learner inputs, e.g. by a method's
    step hook): the teacher forwards only the sequences whose value is > 0.5 and the others get
    ``teacher_logprobs`` 0 (``""``: every sequence; ``teacher_logprobs`` alone)."""

    top_k: int = 8
    rows: str = ""

    def check(self) -> None:
        """``top_k`` >= 1."""
        if self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1")


def check_rows(rows: str, names: frozenset) -> None:
    """Refuse ``inputs.teacher_logprobs.rows`` with the teacher's logits or top-K."""
    if rows and names - {"teacher_logprobs"}:
        raise ValueError(
            f"inputs.teacher_logprobs.rows={rows!r} restricts the teacher_logprobs forward only; this "
            f"run also needs {sorted(names - {'teacher_logprobs'})} of every sequence"
        )


def selected_rows(batch: PackedBatch, rows: str) -> list[int] | None:
    """The sequences the teacher forwards (``rows`` of ``TeacherKnobs``; None: every sequence)."""
    if not rows:
        return None
    v = batch.extras.get(rows)
    if v is None or v.shape != (batch.num_seqs,):
        got = "absent" if v is None else f"of shape {tuple(v.shape)}"
        raise ValueError(
            f"inputs.teacher_logprobs.rows={rows!r}: batch.extras[{rows!r}] is {got}, expected "
            f"[{batch.num_seqs}] set before the learner inputs"
        )
    return (v > 0.5).nonzero()[:, 0].tolist()


def token_index(batch: PackedBatch, seqs: list[int]) -> torch.Tensor:
    """[T'] the batch's token positions of the sequences ``seqs``, in order."""
    cu = batch.cu_seqlens.tolist()
    parts = [torch.arange(cu[i], cu[i + 1]) for i in seqs]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def topk_logprobs(logits: torch.Tensor, k: int, tp_group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k], logprobs [T, k]) of the k most likely tokens of vocab-parallel ``logits``."""
    from megarl.ops.vocab_parallel import vocab_parallel_logsumexp, vocab_parallel_topk

    vals, ids = vocab_parallel_topk(logits, k, tp_group)
    lse = vocab_parallel_logsumexp(logits.float(), tp_group)
    return ids, vals.float() - lse.unsqueeze(-1)


class MegatronTeacherPass:
    """Fills the requested teacher inputs (``names``) with forward passes of a teacher learner."""

    def __init__(self, learner: Any, names: frozenset, top_k: int = 8, rows: str = ""):
        check_rows(rows, names)
        self.learner, self.names, self.top_k, self.rows = learner, names, top_k, rows

    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """In place (collective)."""
        seqs = selected_rows(batch, self.rows)
        if seqs is not None:  # every rank holds the same whole batch: the same selection
            lp = torch.zeros(batch.num_tokens, dtype=torch.float32)
            if seqs:
                sub = batch.select(seqs)
                sub_lp, _ = self.learner.compute_logprobs(sub, max(1, min(micro_batches, len(seqs))))
                lp = lp.to(sub_lp.dtype)
                lp[token_index(batch, seqs)] = sub_lp.cpu()
            batch.teacher_logprobs = lp
            return {"teacher/forwarded_frac": len(seqs) / max(1, batch.num_seqs)}
        if "teacher_logprobs" in self.names:
            batch.teacher_logprobs, _ = self.learner.compute_logprobs(batch, micro_batches)
        if not self.names & {"teacher_logits", "teacher_topk"}:
            return {}
        if "teacher_logits" not in self.names:  # top-K only: the learner's pass never needs [T, V/tp]
            top = self.learner.compute_topk_logprobs(batch, self.top_k, micro_batches)
            if top is not None:  # None: not the last pipeline stage
                batch.token_extras["teacher_topk_ids"] = top[0].cpu()
                batch.token_extras["teacher_topk_logprobs"] = top[1].cpu()
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
