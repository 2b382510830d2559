"""Per-token divergences between a student's and a teacher's next-token distributions, over the
full vocabulary or over the teacher's top-K ids, on vocab-parallel logits (nothing gathered but
the K candidates). Formulas: reference/self_distillation.py ``token_divergence``.

- ``top_k = 0``: KL over the full vocabulary (``vocab_parallel_kl``); ``forward`` is
  KL(teacher ‖ student), ``reverse`` KL(student ‖ teacher);
- ``top_k = K``: both distributions restricted to the teacher's K most likely ids and renormalised
  over them (q̄, p̄), then the same KL over the K: K values per token instead of V/tp. With every
  id in the top-K it is the full-vocabulary KL.

The teacher's logits never get a gradient; the student's do (``student`` may require grad).
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.ops.vocab_parallel import vocab_parallel_gather_logprobs, vocab_parallel_kl, vocab_parallel_topk

DIRECTIONS = ("forward", "reverse")


def token_divergence(
    student: torch.Tensor,
    teacher: torch.Tensor,
    direction: str = "forward",
    top_k: int = 0,
    tp_group: Any = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """[T] KL per token of vocab-parallel logits [T, V/tp] (see the module docstring)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r}; known: {', '.join(DIRECTIONS)}")
    if top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0: the full vocabulary)")
    t = teacher.detach()
    if top_k == 0:
        a, b = (t, student) if direction == "forward" else (student, t)
        return vocab_parallel_kl(a, b, tp_group, chunk_tokens)
    _, ids = vocab_parallel_topk(t, top_k, tp_group)
    lq = torch.log_softmax(vocab_parallel_gather_logprobs(t, ids, tp_group, chunk_tokens), -1)
    lp = torch.log_softmax(vocab_parallel_gather_logprobs(student, ids, tp_group, chunk_tokens), -1)
    lp = lp.to(lq.dtype)
    if direction == "forward":
        return (lq.exp() * (lq - lp)).sum(-1)
    return (lp.exp() * (lp - lq)).sum(-1)
