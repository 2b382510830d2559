"""Several verified solutions per target: the self-teacher reads each of up to m solutions in turn
and teaches with their mixture (reconstructed: U-OPSD's "average over several verified
solutions"; formulas reference/self_distillation.py ``uopsd_select_many``, ``mixture_logprobs``).

- choice: per target, the m shortest rollouts that agree with the group's majority answer (or are
  correct, ``source: sibling``; never the target itself), ties by index; fewer when fewer agree;
- context rows: m blocks of ``max_tokens`` columns (``extras['self_teacher_context']`` [B, m·K],
  an all-NaN block: no solution), and ``extras['self_teacher_blocks']`` = m;
- teacher logprob of each token: log((1/c) Σ_j π(y_t | x, s_j, y_<t)) over the c ≥ 1 solutions the
  target has, one privileged forward per block (the mixture of the self-conditioned
  distributions, evaluated at the sampled token); 0 where c = 0.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.batch import PackedBatch

BLOCKS = "self_teacher_blocks"  # extras [B]: how many context blocks a row holds (m)


def choose_context_sets(
    lengths: list[int], correct: list[bool], source: str, when: str, usable: bool, m: int
) -> list[list[int]]:
    """For one group: per sample, the indices of up to ``m`` samples whose texts are its contexts
    (the shortest first; [] for none). ``source``: sibling (others correct) or majority (the
    majority's samples, the sample itself excluded); ``when`` as ``choose_contexts``."""
    from megarl.methods.distillation.self_teacher import choose_contexts

    first = choose_contexts(lengths, correct, source, when, usable)
    ok = [i for i in range(len(lengths)) if correct[i]]
    out: list[list[int]] = []
    for i, pick in enumerate(first):
        if pick is None:
            out.append([])
            continue
        others = sorted((j for j in ok if j != i), key=lambda j: (lengths[j], j))
        out.append(others[:m])
    return out


def block_rows(rows: torch.Tensor, m: int) -> list[torch.Tensor]:
    """The m context blocks [B, K] of rows [B, m·K]."""
    if rows.shape[1] % m:
        raise ValueError(f"{BLOCKS}={m}: context rows of width {rows.shape[1]} do not split into {m} blocks")
    return list(rows.split(rows.shape[1] // m, dim=1))


def mixture_logprobs(
    logprobs_of: Any, batch: PackedBatch, rows: torch.Tensor, m: int, micro_batches: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher logprobs [T]: log of the mean over a sequence's available solutions of the
    self-conditioned probabilities, 0 without any; [B] solutions read per sequence).
    ``logprobs_of(batch, block_rows, micro_batches)`` -> (logprobs [T], forwarded [B]) for one
    block (collective)."""
    seq = batch.seq_index()
    per, has = [], []
    for block in block_rows(rows, m):
        lp, on = logprobs_of(batch, block, micro_batches)
        per.append(lp.double())
        has.append(on)
    lp, on = torch.stack(per), torch.stack(has)  # [m, T], [m, B]
    on_tok = on[:, seq]
    count = on.sum(0)
    neg = torch.full_like(lp, float("-inf"))
    mix = torch.logsumexp(torch.where(on_tok, lp, neg), 0) - torch.log(count.clamp(min=1).double())[seq]
    return torch.where(count[seq] > 0, mix, torch.zeros_like(mix)).float(), count


def mixture_logits(
    logits_of: Any, batch: PackedBatch, rows: torch.Tensor, m: int, micro_batches: int, tp_group: Any = None
) -> torch.Tensor | None:
    """This rank's vocab shard [T, V/tp] of the mixture's log-probabilities, log((1/c) Σ_j
    softmax(z_j)), over each sequence's available solutions (usable as logits: already
    normalised), 0 where a sequence has none; None off the last pipeline stage or with no
    solution at all. ``logits_of(batch, block_rows, micro_batches)`` -> a block's aligned logits
    [T, V/tp] or None (collective)."""
    from megarl.ops.vocab_parallel import vocab_parallel_logsumexp

    seq = batch.seq_index()
    parts, ons = [], []
    for block in block_rows(rows, m):
        z = logits_of(batch, block, micro_batches)
        if z is None:
            continue
        acc = torch.promote_types(z.dtype, torch.float32)
        lse = vocab_parallel_logsumexp(z.to(acc), tp_group)
        parts.append(z.to(acc) - lse.unsqueeze(-1))
        ons.append((~torch.isnan(block).all(1))[seq].to(z.device))
    if not parts:
        return None
    lp, on = torch.stack(parts), torch.stack(ons)  # [m', T, V/tp], [m', T]
    count = on.sum(0)
    masked = torch.where(on.unsqueeze(-1), lp, torch.full_like(lp, float("-inf")))
    mix = torch.logsumexp(masked, 0) - torch.log(count.clamp(min=1).to(lp.dtype)).unsqueeze(-1)
    return torch.where((count > 0).unsqueeze(-1), mix, torch.zeros_like(mix))
