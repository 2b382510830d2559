"""GUPO: groups weighted by the reliability of their gradients (formula reconstructed from the abstract).

Before the optimizer steps of an RL step, one extra forward and backward pass of the policy-gradient
surrogate ``-sum_t m_t A_t log pi(y_t) / N`` (the gradient of PPO-clip at ratio 1) gives a JL sketch
``u_i`` of every rollout's gradient (megarl.methods.gradients.sketch: per-sequence Kronecker
sketches from module hooks, summed over the model-parallel shards and data-parallel replicas).
From the sketches, each group q gets evidence of agreement and a Dirichlet over {agree, conflict};
its weight ``w_q`` (mean 1 over the groups with a gradient) scales the group's advantages, so the
update is ``sum_q w_q g_q`` (the PPO-clip family is positively homogeneous in the advantage).
KL and entropy terms of the objective are not weighted.

``evidence: rollout_agreement`` (default), consensus ``c = mean_q mean_i u_{q,i}``:
    e+_q = sum_i max(0, cos(u_{q,i}, c)),  e-_q = sum_i max(0, -cos(u_{q,i}, c))
    S_q = e+_q + e-_q + 2,  belief b_q = e+_q / S_q,  uncertainty = 2 / S_q,  w_q ∝ b_q
``evidence: group_dispersion``, group mean ``mu_q = mean_i u_{q,i}``, spread
``s2_q = mean_i |u_{q,i} - mu_q|²``, consensus of the other groups ``c_{-q} = mean_{q' != q} mu_q'``:
    e_q = G_q max(0, cos(mu_q, c_{-q})) / (1 + s2_q / |mu_q|²),  S_q = e_q + 2,
    uncertainty = 2 / S_q,  w_q ∝ 1 - uncertainty
Groups whose sketch is zero (equal rewards: no gradient) keep w = 1; if every weight is 0 all are 1.
Reference: reference/gradients.py (``gupo_weights``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.methods.gradients.sketch import GroupSketcher, sequence_sketches
from megarl.objectives.api import GlobalNormalisers, LossContext, LossOutput
from megarl.ops.vocab_parallel import vocab_parallel_logprobs_entropy
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodParts, MethodSpec

EVIDENCE_KINDS: tuple[str, ...] = ("rollout_agreement", "group_dispersion")
_ROW = "gupo_row"


@dataclass
class GupoKnobs(Knobs):
    """evidence: how a group's evidence is read from the sketches (module docstring);
    sketch_rank: r of the r x r Kronecker sketch per layer (sketch size r²); seed: of the projections."""

    evidence: str = "rollout_agreement"
    sketch_rank: int = 24
    seed: int = 0

    def check(self) -> None:
        """Names and ranges."""
        if self.evidence not in EVIDENCE_KINDS:
            raise ValueError(f"evidence={self.evidence!r}; known: {', '.join(EVIDENCE_KINDS)}")
        if not 1 <= self.sketch_rank <= 256:
            raise ValueError(f"sketch_rank={self.sketch_rank} must be in [1, 256]")


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine of ``a`` [N, d] with ``b`` [N, d] or [d]; 0 where either is zero."""
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    den = na * nb
    return torch.where(den > 0, (a * b).sum(-1) / den.clamp(min=1e-300), torch.zeros_like(den))


def gupo_weights(
    sketches: torch.Tensor, group_of: torch.Tensor, evidence: str = "rollout_agreement"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [Q], uncertainties [Q]) of the groups from per-rollout sketches ``[B, d]`` and the
    dense group index ``group_of`` [B] in 0..Q-1 (see the module docstring)."""
    u = sketches.double()
    Q = int(group_of.max()) + 1
    counts = torch.bincount(group_of, minlength=Q).double()
    mu = torch.zeros(Q, u.shape[1], dtype=u.dtype).index_add_(0, group_of, u) / counts[:, None]
    live = u.norm(dim=1) > 0
    active = torch.zeros(Q, dtype=torch.bool).index_put_((group_of[live],), torch.tensor(True))
    if evidence == "rollout_agreement":
        consensus = mu[active].mean(0) if bool(active.any()) else mu.mean(0)
        c = _cos(u, consensus)
        pos = torch.zeros(Q, dtype=u.dtype).index_add_(0, group_of, c.clamp(min=0))
        neg = torch.zeros(Q, dtype=u.dtype).index_add_(0, group_of, (-c).clamp(min=0))
        s = pos + neg + 2
        raw = pos / s
    elif evidence == "group_dispersion":
        spread = torch.zeros(Q, dtype=u.dtype).index_add_(0, group_of, (u - mu[group_of]).pow(2).sum(1))
        spread = spread / counts
        n_act = int(active.sum())
        total = mu[active].sum(0)
        others = (total[None, :] - mu) / max(n_act - 1, 1)  # mean of the other active groups
        agree = _cos(mu, others).clamp(min=0) if n_act > 1 else torch.ones(Q, dtype=u.dtype)
        m2 = mu.pow(2).sum(1)
        e = torch.where(m2 > 0, counts * agree / (1 + spread / m2.clamp(min=1e-300)), torch.zeros_like(m2))
        s = e + 2
        raw = e / s
    else:
        raise ValueError(f"method.evidence={evidence!r}; known: {', '.join(EVIDENCE_KINDS)}")
    w = torch.ones(Q, dtype=u.dtype)
    total = raw[active].sum()
    if total > 0:
        w[active] = raw[active] * int(active.sum()) / total
    return w, 2 / s


class PolicyGradientSurrogate:
    """``-sum_t m_t A_t log pi(y_t) / N_tokens``: PPO-clip's gradient at ratio 1 (the sketch pass)."""

    def __call__(self, logits: torch.Tensor, batch: PackedBatch, ctx: LossContext) -> LossOutput:
        """The loss of one micro-batch."""
        lp, _ = vocab_parallel_logprobs_entropy(
            logits, batch.tokens.to(logits.device), ctx.tp_group, ctx.chunk_tokens, with_entropy=False
        )
        m = batch.loss_mask.to(lp) * batch.advantages.to(lp)
        return LossOutput(loss=-(lp * m).sum() / max(ctx.normalisers.num_tokens, 1.0))


def scale_advantages(batch: PackedBatch, weights: torch.Tensor, group_of: torch.Tensor) -> torch.Tensor:
    """``batch.advantages`` [T] with each sequence's tokens multiplied by its group's weight."""
    lens = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
    per_token = torch.repeat_interleave(weights[group_of], lens)
    return (batch.advantages.double() * per_token).to(batch.advantages.dtype)


class GupoHook:
    """The step hook: sketch pass, weights, weighted advantages (every rank; collective)."""

    def __init__(self, ctx: Any, knobs: GupoKnobs):
        self.ctx, self.knobs = ctx, knobs
        self.objective = PolicyGradientSurrogate()
        self._sketcher: GroupSketcher | None = None  # hooks the policy's model at the first step
        self._metrics: dict[str, float] = {}

    @property
    def sketcher(self) -> GroupSketcher:
        """The sketch hooks on the policy learner's model (made once)."""
        if self._sketcher is None:
            self.ctx.policy.require_whole_rows("GUPO's gradient sketches")
            g = self.ctx.policy.groups
            tp = g.tp if g.layout.tp > 1 else None
            self._sketcher = GroupSketcher(self.ctx.policy.model, tp, self.knobs.sketch_rank, self.knobs.seed)
        return self._sketcher

    def weights(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [Q], uncertainties [Q], dense group index [B]) of ``batch`` (the whole RL step)."""
        batch.extras[_ROW] = torch.arange(batch.num_seqs)
        try:
            local = self.ctx.dp_share(batch)
            rows = local.extras[_ROW].long()
        finally:
            batch.extras.pop(_ROW, None)
        local.extras.pop(_ROW, None)
        norms = GlobalNormalisers.from_batch(local, self.ctx.dp_group)
        micro = max(1, min(self.ctx.cfg.schedule.micro_batches, local.num_seqs))
        u = sequence_sketches(
            self.ctx.policy, self.sketcher, local, rows, batch.num_seqs, self.objective, micro, norms
        )
        group_of = torch.unique(batch.group_ids, return_inverse=True)[1]
        w, unc = gupo_weights(u, group_of, self.knobs.evidence)
        return w, unc, group_of

    def before_train(self, step: int, batch: PackedBatch) -> PackedBatch:
        """Weight every group's advantages by its GUPO weight."""
        t0 = time.time()
        w, unc, group_of = self.weights(batch)
        batch.advantages = scale_advantages(batch, w, group_of)
        self._metrics = {
            "gupo/weight_min": float(w.min()),
            "gupo/weight_max": float(w.max()),
            "gupo/weight_std": float(w.std()) if w.numel() > 1 else 0.0,
            "gupo/uncertainty_mean": float(unc.mean()),
            "gupo/sketch_seconds": time.time() - t0,
        }
        return batch

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        """The weights' summary of this step."""
        return dict(self._metrics)

    def state_dict(self) -> dict:
        """Stateless (the projections come from the seed)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


def build(ctx: Any, knobs: GupoKnobs) -> MethodParts:
    """The GUPO step hook."""
    return MethodParts(step_hooks=[GupoHook(ctx, knobs)])


SPEC = MethodSpec(
    name="gupo",
    summary="GUPO: groups weighted by the Dirichlet reliability of their sketched gradients",
    provenance="reconstructed",
    config={"advantage": {"estimator": "grpo"}},
    knobs=GupoKnobs,
    build=build,
)
