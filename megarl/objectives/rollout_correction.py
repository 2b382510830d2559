"""The rollout correction of one batch, composed from the configured parts (formulas in
reference/corrections.py: ``rollout_correction``):

    keep = keep_correction · Π_j keep_j                 chained criteria, each with its own threshold
    c    = correction(w) · keep                         (correction ``none``: c = keep, rejection only)
    drop:      loss mask m' = m · keep                  rejected tokens leave every denominator
    normalise: c / mean(c over m')                      token-level; over sequences for ``seq_tis``

``normalise`` and ``drop`` need the whole global batch, so ``prepare`` computes them once per
optimizer step (reduced over the DP group) and stores c per token in ``token_extras``; the learner
recounts the normalisers of the narrowed mask (``narrows_loss_mask``, api.step_normalisers).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.objectives.corrections import CORRECTIONS, CRITERIA
from megarl.objectives.objective_config import ObjectiveConfig
from megarl.ops import comm
from megarl.ops.segments import segment_masked_mean, segment_sum

MULTIPLIER = "rollout_correction"  # token_extras: c per token, set by prepare
DROPPED = "rollout_correction_dropped"  # extras: per sequence, dropped tokens / global loss tokens
SEQUENCE_LEVEL = ("seq_tis",)  # corrections whose weight is one per sequence (normalised over sequences)


def active(cfg: ObjectiveConfig) -> bool:
    """True when a correction or a chained criterion is configured."""
    return cfg.correction != "none" or bool(cfg.correction_chain)


def global_stage(cfg: ObjectiveConfig) -> bool:
    """True when the correction needs ``prepare`` (batch normalisation or the dropping denominator)."""
    return active(cfg) and (cfg.correction_normalise or cfg.correction_denominator == "drop")


def multiplier_and_keep(
    cfg: ObjectiveConfig, old: torch.Tensor, roll: torch.Tensor, mask: torch.Tensor, cu: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(c [T], keep [T] bool): the correction times the keeps of every chained criterion."""
    lo, hi = cfg.correction_low, cfg.correction_high
    c = CORRECTIONS.get(cfg.correction)(old, roll, mask, cu, lo, hi)
    keep = CRITERIA[cfg.correction](old, roll, mask, cu, lo, hi) if cfg.correction in CRITERIA else None
    for crit in cfg.correction_chain:
        k = CRITERIA[crit["name"]](old, roll, mask, cu, crit.get("low", lo), crit["high"])
        keep = k if keep is None else keep & k
    if keep is None:
        keep = torch.ones_like(old, dtype=torch.bool)
    return c * keep.to(c.dtype), keep


def batch_mean(
    c: torch.Tensor, mask: torch.Tensor, cu: torch.Tensor, per_sequence: bool, dp_group: Any
) -> float:
    """Mean of c over the loss tokens of the global batch (``per_sequence``: over the sequences
    with a loss token, of each one's mean c), summed over ``dp_group``."""
    m = mask.to(torch.float64)
    if per_sequence:
        n = segment_sum(m, cu)
        s = torch.stack([segment_masked_mean(c.double(), m, cu)[n > 0].sum(), (n > 0).sum().double()])
    else:
        s = torch.stack([(c.double() * m).sum(), m.sum()])
    s = s.cpu()  # reduced like GlobalNormalisers' counts (host tensors)
    comm.all_reduce(s, "sum", dp_group)
    return float(s[0] / s[1]) if float(s[1]) > 0 else 1.0


def prepare(cfg: ObjectiveConfig, batch: PackedBatch, dp_group: Any = None) -> PackedBatch:
    """The batch with c in ``token_extras[MULTIPLIER]`` (normalised when asked) and, under
    ``correction_denominator: drop``, the rejected tokens out of its loss mask; unchanged when the
    correction needs no global stage. Call on this DP rank's whole batch, on every rank."""
    if not global_stage(cfg):
        return batch
    if batch.old_logprobs is None or batch.rollout_logprobs is None:
        raise ValueError(f"correction={cfg.correction!r} needs 'old_logprobs' and 'rollout_logprobs'")
    old = batch.old_logprobs.double()
    roll = batch.rollout_logprobs.double().to(old.device)
    mask, cu = batch.loss_mask.to(old.device, torch.float64), batch.cu_seqlens.to(old.device)
    c, keep = multiplier_and_keep(cfg, old, roll, mask, cu)
    extras, tok = dict(batch.extras), dict(batch.token_extras)
    kept = mask
    if cfg.correction_denominator == "drop":
        kept = mask * keep.to(mask.dtype)
        total = mask.sum().reshape(1).cpu()
        comm.all_reduce(total, "sum", dp_group)
        extras[DROPPED] = segment_sum(mask - kept, cu) / max(float(total), 1.0)
    if cfg.correction_normalise:
        mean = batch_mean(c, kept, cu, cfg.correction in SEQUENCE_LEVEL, dp_group)
        c = c / mean if mean > 0 else c
    tok[MULTIPLIER] = c
    loss_mask = kept.to(batch.loss_mask.device, batch.loss_mask.dtype)
    return dataclasses.replace(batch, loss_mask=loss_mask, extras=extras, token_extras=tok)
