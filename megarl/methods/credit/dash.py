"""DASH: segment-level credit from intermediate answer commitments (formula: reference/credit.py).

Per sequence the batch carries its checkpoints in ``extras``:
``dash_ends`` [B, K] long: sequence position just after the token completing answer k (ascending,
-1 = none) and ``dash_correct`` [B, K] float: 1 if answer k equals the ground truth (else 0).
``answer_checkpoints`` builds both from the decoded response tokens on the CPU.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo, scalar_rewards
from megarl.ops.segments import broadcast_to_tokens
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

BOXED = r"\\boxed\{([^{}]*)\}"


def answer_checkpoints(
    token_texts: Sequence[str], prompt_len: int, ground_truth: str, pattern: str = BOXED
) -> list[tuple[int, int]]:
    """(end position in the sequence, correct) for each answer the response commits to.

    ``token_texts``: the decoded text of each *response* token, in order. A match ending inside
    token j ends its segment at sequence position prompt_len + j + 1. Answers are compared after
    stripping whitespace.
    """
    text = "".join(token_texts)
    char_to_tok = [j for j, piece in enumerate(token_texts) for _ in piece]
    out = []
    for m in re.finditer(pattern, text):
        j = char_to_tok[m.end() - 1]
        answer = m.group(1) if m.groups() else m.group(0)
        out.append((prompt_len + j + 1, int(answer.strip() == ground_truth.strip())))
    merged: dict[int, int] = {}
    for end, c in out:  # two answers closing in the same token: the later one counts
        merged[end] = c
    return sorted(merged.items())


def checkpoints_to_extras(checkpoints: Sequence[Sequence[tuple[int, int]]]) -> dict[str, torch.Tensor]:
    """Per-sequence checkpoint lists -> ``{"dash_ends": [B, K], "dash_correct": [B, K]}`` (-1 padded)."""
    K = max([len(c) for c in checkpoints] + [1])
    ends = torch.full((len(checkpoints), K), -1, dtype=torch.long)
    correct = torch.full((len(checkpoints), K), -1.0, dtype=torch.float64)
    for i, cps in enumerate(checkpoints):
        for k, (e, c) in enumerate(sorted(cps)):
            ends[i, k], correct[i, k] = e, float(c)
    return {"dash_ends": ends, "dash_correct": correct}


def dash_token_advantages(
    base: torch.Tensor,
    ends: torch.Tensor,
    correct: torch.Tensor,
    cu_seqlens: torch.Tensor,
    beta: float = 0.5,
    beta_drift: float = 0.5,
) -> torch.Tensor:
    """A_t = base_i + β(2c_k − 1) + β'(c_k − c_{k−1}) for t in segment k; base_i where no checkpoint.

    base: [B]; ends, correct: [B, K]; -> [T] (before masking).
    """
    seq = torch.repeat_interleave(torch.arange(ends.shape[0]), cu_seqlens[1:] - cu_seqlens[:-1])
    pos = torch.arange(int(cu_seqlens[-1])) - cu_seqlens[:-1][seq]  # position inside the sequence
    valid = ends >= 0
    if bool(((ends[:, 1:] <= ends[:, :-1]) & valid[:, 1:]).any()):
        bad = int(((ends[:, 1:] <= ends[:, :-1]) & valid[:, 1:]).any(1).nonzero()[0])
        raise ValueError(f"extras.dash_ends, sequence {bad}: checkpoint ends must be strictly ascending")
    n = valid.sum(1)  # [B]
    passed = (valid[seq] & (ends[seq] <= pos.unsqueeze(1))).sum(1)  # checkpoints already closed
    k = torch.minimum(passed, (n[seq] - 1).clamp(min=0))
    c = correct[seq, k].to(base.dtype)
    c_prev = torch.where(k > 0, correct[seq, (k - 1).clamp(min=0)].to(base.dtype), torch.zeros_like(c))
    shift = beta * (2 * c - 1) + beta_drift * (c - c_prev)
    return broadcast_to_tokens(base, cu_seqlens) + torch.where(n[seq] > 0, shift, torch.zeros_like(shift))


def _dash(batch, beta: float = 0.5, beta_drift: float = 0.5) -> torch.Tensor:
    """DASH on the loss tokens; sequences without checkpoints keep the GRPO advantage. [T]"""
    for key in ("dash_ends", "dash_correct"):
        if key not in batch.extras:
            raise ValueError(f"advantage_estimator=dash needs batch.extras['{key}'] (see answer_checkpoints)")
    base = grpo(scalar_rewards(batch), batch.group_ids)
    adv = dash_token_advantages(
        base, batch.extras["dash_ends"], batch.extras["dash_correct"], batch.cu_seqlens, beta, beta_drift
    )
    return adv * batch.loss_mask.double()


ADVANTAGE_ESTIMATORS.add("dash", _dash, PartInfo(batch_inputs=("answer_checkpoints",)))

SPEC = MethodSpec(
    name="dash",
    summary="DASH: segment credit from intermediate answer commitments",
    provenance="reconstructed",
    config={"advantage": {"estimator": "dash"}},
)
