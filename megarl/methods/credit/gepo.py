"""GEPO: group-entropy-conditioned asymmetric advantage shaping (formula: reference/credit.py).

Needs the behaviour policy's full-vocabulary entropy per token in ``batch.entropies`` (the learner's
old-logprob pass computes it from vocab-parallel logits: ``Learner.compute_logprobs(...,
with_entropy=True)``, or ``megarl.ops.vocab_parallel.vocab_parallel_entropy``). The entropy
history is a ``GEPOHistory``: the caller makes it once with the estimator's ``make_state(**knobs)``
(the same convention as the objective's stateful parts), passes it as ``state=`` every step and
saves ``state.state_dict()`` in checkpoints. Without ``state`` the thresholds come from the
current batch only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo, per_token, scalar_rewards
from megarl.ops.segments import _dense_groups, segment_sum
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


@dataclass
class GEPOHistory:
    """EMA of the mean and of the mean square of group entropies H_g (None until the first batch)."""

    mean: float | None = None
    sq: float | None = None
    beta: float = 0.9

    def state_dict(self) -> dict:
        return {"mean": self.mean, "sq": self.sq, "beta": self.beta}

    def load_state_dict(self, d: dict) -> None:
        self.mean, self.sq, self.beta = d["mean"], d["sq"], d["beta"]

    def metrics(self) -> dict[str, float]:
        """The thresholds' running mean and std ({} before the first batch)."""
        if self.mean is None or self.sq is None:
            return {}
        return {
            "adv/gepo_h_mean": float(self.mean),
            "adv/gepo_h_std": float(max(self.sq - self.mean**2, 0.0) ** 0.5),
        }


def group_entropy(
    entropies: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, group_ids: torch.Tensor
) -> torch.Tensor:
    """Per-sequence H_g: token-mean entropy over all loss tokens of the sequence's group; [T] -> [B]."""
    m = mask.double()
    inv, n = _dense_groups(group_ids)
    s = torch.zeros(n, dtype=torch.float64).index_add(0, inv, segment_sum(entropies.double() * m, cu_seqlens))
    c = torch.zeros(n, dtype=torch.float64).index_add(0, inv, segment_sum(m, cu_seqlens))
    return (s / c.clamp(min=1))[inv]


def gepo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    h_seq: torch.Tensor,
    history: GEPOHistory,
    k: float = 0.5,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages attenuated by the group entropy against history thresholds; updates ``history``.

    rewards, group_ids, h_seq (H_g per sequence): [B] -> [B].
    """
    inv, n = _dense_groups(group_ids)
    hg = torch.zeros(n, dtype=torch.float64).index_copy(0, inv, h_seq.double())  # one value per group
    b_mean, b_sq = float(hg.mean()), float((hg**2).mean())
    mu, sq = (b_mean, b_sq) if history.mean is None else (history.mean, history.sq)
    sigma = math.sqrt(max(sq - mu * mu, 0.0)) + eps
    lo, hi = mu - k * sigma, mu + k * sigma
    adv = grpo(rewards, group_ids)
    h = h_seq.double()
    damp_pos = torch.exp(-(lo - h) / sigma)
    damp_neg = torch.exp(-(h - hi) / sigma)
    adv = torch.where((h < lo) & (adv > 0), damp_pos * adv, adv)
    adv = torch.where((h > hi) & (adv < 0), damp_neg * adv, adv)
    if history.mean is None:
        history.mean, history.sq = b_mean, b_sq
    else:
        history.mean = history.beta * history.mean + (1 - history.beta) * b_mean
        history.sq = history.beta * history.sq + (1 - history.beta) * b_sq
    return adv


def _gepo(
    batch, k: float = 0.5, beta: float = 0.9, eps: float = 1e-6, state: GEPOHistory | None = None
) -> torch.Tensor:
    """GEPO on every loss token; ``state`` (kept by the caller across steps) defaults to a fresh one."""
    if batch.entropies is None:
        raise ValueError(
            "advantage_estimator=gepo needs the batch field 'entropies' (behaviour-policy entropy)"
        )
    if state is None:
        state = GEPOHistory(beta=beta)
    h = group_entropy(batch.entropies, batch.loss_mask, batch.cu_seqlens, batch.group_ids)
    return per_token(batch, gepo(scalar_rewards(batch), batch.group_ids, h, state, k, eps))


ADVANTAGE_ESTIMATORS.add(
    "gepo",
    _gepo,
    PartInfo(
        batch_inputs=("entropies",),
        make_state=lambda k=0.5, beta=0.9, eps=1e-6: GEPOHistory(beta=beta),
        group_relative=True,
    ),
)

SPEC = MethodSpec(
    name="gepo",
    summary="GEPO: GRPO advantages attenuated by the group's entropy",
    provenance="reconstructed",
    config={"advantage": {"estimator": "gepo"}},
)
