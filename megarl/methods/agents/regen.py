"""REGEN: offline RL on replayed expert rollouts, registered as the policy loss ``regen``
(formula: reference/agents.py:regen_loss).

    log π_b = Σ_t m log π_θ(y_t),  log μ_b = −z_b            (÷ n_b with length_normalize)
    w_b = clip(exp(min(log π_b − log μ_b, log c_max)), 0, α) on a negative sample, else 1 (no gradient)
    ℓ_b = −A_b · w_b · log π_b, batch loss = mean over sequences

The sequence loss is spread over the sequence's tokens (−A_b w_b log π_θ(y_t), ÷ n_b with
length_normalize), so the method's ``seq-mean-token-sum`` aggregation is the mean over sequences,
exact under micro-batching and data parallelism. Per sequence, the loss reads the behaviour NLL z_b
from ``extras["behaviour_nll"]`` (replayed episodes), else −Σ_t of the rollout log-probs (else of the
old log-probs); the origin label from ``extras["origin_negative"]`` (1 = negative), else A_b < 0.
A_b is the mean of the advantages over the sequence's loss tokens.

Provenance: code, the authors' trainer (REGEN, arXiv 2607.19450).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.ops.segments import broadcast_to_tokens, segment_masked_mean, segment_sum
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodParts, MethodSpec
from megarl.registry import PartInfo

BEHAVIOUR_NLL = "behaviour_nll"  # extras key: z_b = −log μ(y_b|x_b), [B]
ORIGIN_NEGATIVE = "origin_negative"  # extras key: 1.0 where the origin label is negative, [B]


def _check(alpha: float, clip_ratio_max: float) -> None:
    if not alpha >= 0:
        raise ValueError(f"regen: policy_loss_args.alpha={alpha!r} must be >= 0")
    if not clip_ratio_max > 0:
        raise ValueError(f"regen: policy_loss_args.clip_ratio_max={clip_ratio_max!r} must be > 0")


def regen_sequence_terms(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    batch=None,
    alpha: float = 1.0,
    clip_ratio_max: float = 10.0,
    length_normalize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence [B]: (A_b, w_b, negative_b, n_b or 1) from packed [T] tensors (w has no gradient)."""
    _check(alpha, clip_ratio_max)
    m = mask.to(logp.dtype)
    extras = {} if batch is None else batch.extras
    if BEHAVIOUR_NLL in extras:
        logmu = -extras[BEHAVIOUR_NLL].to(logp.dtype)
    else:
        behaviour = old_logp if batch is None or batch.rollout_logprobs is None else batch.rollout_logprobs
        logmu = segment_sum(behaviour.to(logp.dtype) * m, cu_seqlens)
    seq_logp = segment_sum(logp.detach() * m, cu_seqlens)
    a = segment_masked_mean(adv, m, cu_seqlens)
    norm = segment_sum(m, cu_seqlens).clamp(min=1) if length_normalize else torch.ones_like(a)
    if ORIGIN_NEGATIVE in extras:
        negative = extras[ORIGIN_NEGATIVE].to(torch.bool)
    else:
        negative = a < 0
    log_ratio = torch.clamp((seq_logp - logmu) / norm, max=math.log(clip_ratio_max))
    w = torch.where(negative, torch.clamp(torch.exp(log_ratio), 0.0, alpha), torch.ones_like(a))
    return a, w, negative, norm


def regen(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=None,
    clip_high=None,
    dual_clip=None,
    *,
    alpha: float = 1.0,
    clip_ratio_max: float = 10.0,
    length_normalize: bool = False,
    batch=None,
    ctx=None,
) -> torch.Tensor:
    """−A_b · w_b · log π_θ(y_t) (÷ n_b with length_normalize) per token, [T]; clip_* are unused."""
    a, w, _, norm = regen_sequence_terms(
        logp, old_logp, adv, mask, cu_seqlens, batch, alpha, clip_ratio_max, length_normalize
    )
    return -broadcast_to_tokens(a * w / norm, cu_seqlens) * logp


def _token_metrics(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=None,
    clip_high=None,
    dual_clip=None,
    *,
    alpha: float = 1.0,
    clip_ratio_max: float = 10.0,
    length_normalize: bool = False,
    batch=None,
    ctx=None,
) -> dict[str, torch.Tensor]:
    """Per token of each sequence: its weight w_b and whether its origin is negative."""
    _, w, negative, _ = regen_sequence_terms(
        logp, old_logp, adv, mask, cu_seqlens, batch, alpha, clip_ratio_max, length_normalize
    )
    return {
        "weight": broadcast_to_tokens(w, cu_seqlens),
        "negative_frac": broadcast_to_tokens(negative.to(logp.dtype), cu_seqlens),
    }


POLICY_LOSSES.add("regen", regen, PartInfo(token_metrics=_token_metrics, needs_context=True))


@dataclass
class RegenKnobs(Knobs):
    """replay_out: a folder to write each RL step's episodes to; replay_in: a folder of replay files
    to train on instead of rollouts; replay_batch: episodes per RL step from replay_in (0: the run's
    prompts_per_step x rollout.n). Folders are relative to the run directory; empty: off
    (megarl/methods/agents/replay.py)."""

    replay_out: str = ""
    replay_in: str = ""
    replay_batch: int = 0

    def check(self) -> None:
        """Ranges."""
        if self.replay_batch < 0:
            raise ValueError(f"method.replay_batch={self.replay_batch} must be >= 0")


def build(ctx: Any, knobs: RegenKnobs) -> MethodParts:
    """``replay_out``: the step hook that writes the run's episodes after the advantage step;
    ``replay_in``: the batch source that replays stored episodes (stored advantages, NLLs, labels)."""
    if not (knobs.replay_out or knobs.replay_in):
        return MethodParts()
    from megarl.methods.agents.replay import (
        ReplayReader,
        ReplaySource,
        ReplayWriter,
        chat_template,
        tokenizer_fingerprint,
    )

    run_dir = Path(ctx.cfg.logging.run_dir)
    fp, template = (
        tokenizer_fingerprint(ctx.tokenizer),
        chat_template(ctx.tokenizer, bool(ctx.cfg.data.chat_template)),
    )
    parts = MethodParts()
    if knobs.replay_out:
        parts.step_hooks.append(ReplayWriter(run_dir / knobs.replay_out, fp, template, ctx.rank0))
    if knobs.replay_in:
        size = knobs.replay_batch or ctx.cfg.schedule.prompts_per_step * ctx.cfg.rollout.n
        parts.batch_source = ReplaySource(ReplayReader(run_dir / knobs.replay_in, fp, template), size)
    return parts


SPEC = MethodSpec(
    name="regen",
    summary="REGEN: advantage-weighted likelihood, truncated-IS-weighted on negative samples",
    provenance="code",
    config={"objective": {"policy_loss": "regen", "aggregation": "seq-mean-token-sum"}},
    knobs=RegenKnobs,
    build=build,
)
