"""Rubric Dropout: drop rubric criteria per (step, prompt), shared by the group (formula:
reference/reward_shaping.py).

``RubricDropout(**knobs)(scores, weights, valid, prompt_uids, step, train=True) -> R [B]``. The
mask depends only on (seed, step, prompt uid), so every data-parallel rank holding part of a group
draws the same mask without communication, and every rollout of a prompt is scored against the same
criteria (GRPO advantages stay comparable). ``kept_criteria`` tells the judge which criteria it
needs to score at all (dropped ones need no judge call).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from megarl.plugin.rounds import RolloutRound, RoundResult
from megarl.plugin.spec import MethodSpec
from megarl.rewards.shaping.base import RoundShaper
from megarl.rewards.shaping.registry import REWARD_SHAPERS


def keep_mask(seed: int, step: int, prompt_uid: int, num_criteria: int, p: float) -> torch.Tensor:
    """[K] bool: M_k ~ Bernoulli(1−p) from a generator keyed by (seed, step, uid); never all False."""
    key = hashlib.blake2b(f"{seed}:{step}:{prompt_uid}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    keep = torch.rand(num_criteria, generator=gen, dtype=torch.float64) >= p
    if num_criteria and not bool(keep.any()):
        keep[int(torch.randint(num_criteria, (1,), generator=gen))] = True
    return keep


@REWARD_SHAPERS.register("rubric_dropout")
class RubricDropout(RoundShaper):
    """Rubric reward with per-(step, prompt) criterion dropout; evaluation (train=False) keeps all."""

    def __init__(self, p: float = 0.3, seed: int = 0, keep_pitfalls: bool = True):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"rubric_dropout: p={p} must be in [0, 1)")
        self.p, self.seed, self.keep_pitfalls = p, seed, keep_pitfalls

    def masks(
        self, valid: torch.Tensor, prompt_uids: torch.Tensor, step: int, train: bool = True
    ) -> torch.Tensor:
        """[B, K] bool: criteria that count for each sequence (dropout mask within its valid criteria)."""
        M = valid.clone().bool()
        if not train or self.p == 0:
            return M
        for uid in torch.unique(prompt_uids).tolist():
            rows = (prompt_uids == uid).nonzero().flatten()
            cols = valid[rows[0]].nonzero().flatten()
            if not bool((valid[rows] == valid[rows[0]]).all()):
                raise ValueError(f"rubric_dropout: prompt {uid} has different criteria across its rollouts")
            m = torch.zeros(valid.shape[1], dtype=torch.bool)
            m[cols] = keep_mask(self.seed, step, uid, cols.numel(), self.p)
            M[rows] = m
        return M

    def kept_criteria(self, valid, prompt_uids, step: int, weights=None, train: bool = True) -> torch.Tensor:
        """[B, K] bool: the criteria the judge has to score (kept ones, plus pitfalls if kept always)."""
        M = self.masks(valid, prompt_uids, step, train)
        if self.keep_pitfalls and weights is not None:
            M |= valid.bool() & (weights < 0)
        return M

    def __call__(
        self,
        scores: torch.Tensor,
        weights: torch.Tensor,
        valid: torch.Tensor,
        prompt_uids: torch.Tensor,
        step: int,
        train: bool = True,
    ) -> torch.Tensor:
        """R_i = Σ_k M_k w_k s_k / Σ_k M_k w_k⁺ over the kept criteria; [B, K] inputs -> [B]."""
        if scores.shape != weights.shape or scores.shape != valid.shape:
            raise ValueError(
                f"rubric_dropout: scores {tuple(scores.shape)}, weights {tuple(weights.shape)} and "
                f"valid {tuple(valid.shape)} must have the same shape [B, K]"
            )
        w = weights.double()
        M = self.kept_criteria(valid, prompt_uids, step, w, train).double()
        num = (M * w * scores.double()).sum(1)
        den = (M * w.clamp(min=0)).sum(1)
        return torch.where(
            den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num)
        )

    async def shape_round(self, r: RolloutRound, env: Any) -> RoundResult:
        """The rubric is the round's reward dimensions, one criterion each, weighted by its weight."""
        from megarl.rewards.shaping.processor import dims_matrix

        scores = dims_matrix(r)
        weights = torch.tensor(list(r.weights.values()), dtype=torch.float64).expand_as(scores)
        valid = torch.ones_like(scores, dtype=torch.bool)
        uids = torch.tensor([u for u in r.uids for _ in range(r.n)])
        shaped = self(scores, weights, valid, uids, r.step)
        kept = self.kept_criteria(valid, uids, r.step, weights)
        return RoundResult(shaped, metrics={"shaping/rubric_dropout/kept_frac": float(kept.double().mean())})

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


SPEC = MethodSpec(
    name="rubric_dropout",
    summary="Rubric Dropout: random criteria dropped per prompt and step",
    provenance="reconstructed",
    config={"reward": {"shaping": {"name": "rubric_dropout"}}},
)
