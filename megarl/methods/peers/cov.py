"""Clip-Cov and KL-Cov: tokens with a large covariance between advantage and log-prob are
detached (Clip-Cov) or KL-penalised (KL-Cov); formulas: reference/peers.py.

The selection is one statistic of the whole batch: ``prepare`` (once per optimizer step, on the DP
rank's whole batch, reduced over DP) computes the global means of A and of π_old's log-probs and
either Clip-Cov's keep probability with a random seed per sequence, or KL-Cov's global top-k
threshold; each is stored per sequence in ``batch.extras``. The loss recomputes each token's
covariance from the batch and applies the rule, so any micro-batching selects the same tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.ops import comm
from megarl.ops.segments import broadcast_to_tokens
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

MEANS = "cov_means"  # [B, 2]: mean A, mean old log-prob over the global batch's loss tokens
KEEP_P = "clip_cov_p"  # [B]: Clip-Cov's keep probability of a candidate token
SEED = "clip_cov_seed"  # [B] int64: seed of each sequence's uniform keys
TAU = "kl_cov_tau"  # [B]: KL-Cov's covariance threshold (k-th largest of the global batch)


def _old(batch: PackedBatch) -> torch.Tensor:
    old = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
    if old is None or batch.advantages is None:
        raise ValueError("clip_cov/kl_cov need the batch fields 'advantages' and 'old_logprobs'")
    return old.double()


def _check(ratio: float) -> None:
    if not 0 < ratio <= 1:
        raise ValueError(f"objective.policy_loss_args.ratio={ratio!r} must be in (0, 1]")


def global_means(batch: PackedBatch, dp_group: Any) -> tuple[torch.Tensor, float]:
    """(mean A, mean old) [2] over the loss tokens of all DP ranks, rounded to 2^-20, and their count."""
    m = batch.loss_mask.double()
    s = torch.stack([(m * batch.advantages.double()).sum(), (m * _old(batch)).sum(), m.sum()])
    comm.all_reduce(s, "sum", dp_group)
    n = float(s[2])
    # rounded to 2^-20: the selection then does not hang on the summation order (packing, DP split)
    return torch.round(s[:2] / max(n, 1.0) * 2**20) / 2**20, n


def covariance(batch: PackedBatch, means: torch.Tensor) -> torch.Tensor:
    """cov_t = (A_t − mean A)(old_t − mean old) on loss tokens, 0 elsewhere; means [B, 2]; [T] fp64."""
    mt = broadcast_to_tokens(means.double(), batch.cu_seqlens)
    cov = (batch.advantages.double() - mt[:, 0]) * (_old(batch) - mt[:, 1])
    return torch.where(batch.loss_mask.bool(), cov, torch.zeros_like(cov))


def _per_seq(batch: PackedBatch, x: torch.Tensor) -> torch.Tensor:
    return x.expand(batch.num_seqs, *x.shape).clone()


@dataclasses.dataclass
class CovDraws:
    """Clip-Cov's random stream: a seed and the number of draws so far (checkpointed)."""

    seed: int = 0
    draws: int = 0

    def generator(self, rank: int) -> torch.Generator:
        """A generator for this draw on DP rank ``rank`` (then counts the draw)."""
        g = torch.Generator().manual_seed(hash((self.seed, self.draws, rank)) % (2**62))
        self.draws += 1
        return g

    def state_dict(self) -> dict:
        return {"seed": self.seed, "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.draws = int(state["seed"]), int(state["draws"])


def _make_draws(*, seed: int = 0, **_) -> CovDraws:
    return CovDraws(seed=int(seed))


def prepare_clip_cov(
    batch: PackedBatch,
    dp_group: Any,
    state: CovDraws | None = None,
    *,
    ratio: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    **_,
) -> PackedBatch:
    """extras: global means, keep probability p = min(1, k/#candidates), one key seed per sequence."""
    _check(ratio)
    means, n_tok = global_means(batch, dp_group)
    means = _per_seq(batch, means)
    cov = covariance(batch, means)
    cand = torch.stack([((cov > cov_low) & (cov < cov_high) & batch.loss_mask.bool()).sum().double()])
    comm.all_reduce(cand, "sum", dp_group)
    k = max(int(ratio * n_tok), 1)
    p = min(1.0, k / max(float(cand[0]), 1.0))
    g = (state or CovDraws()).generator(comm.rank(dp_group))
    seeds = torch.randint(0, 2**62, (batch.num_seqs,), generator=g)
    extras = {MEANS: means, KEEP_P: torch.full((batch.num_seqs,), p, dtype=torch.float64), SEED: seeds}
    return dataclasses.replace(batch, extras={**batch.extras, **extras})


def token_keys(seeds: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Uniform keys [T] fp64: sequence b's come from a generator seeded with seeds[b]."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    parts = [
        torch.rand(n, generator=torch.Generator().manual_seed(int(s)), dtype=torch.float64)
        for s, n in zip(seeds.tolist(), lens)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _need(batch: PackedBatch, *keys: str) -> None:
    missing = [k for k in keys if k not in batch.extras]
    if missing:
        raise ValueError(
            f"batch.extras has no {missing}: call objective.prepare(batch, dp_group) on the whole batch "
            "before splitting it into micro-batches"
        )


def clip_cov_selected(batch: PackedBatch, cov_low: float, cov_high: float) -> torch.Tensor:
    """bool [T]: candidates (cov_low < cov < cov_high, loss tokens) whose key is below p."""
    _need(batch, MEANS, KEEP_P, SEED)
    cov = covariance(batch, batch.extras[MEANS])
    cand = batch.loss_mask.bool() & (cov > cov_low) & (cov < cov_high)
    keys = token_keys(batch.extras[SEED], batch.cu_seqlens)
    return cand & (keys < broadcast_to_tokens(batch.extras[KEEP_P].double(), batch.cu_seqlens))


def clip_cov(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    *,
    batch: PackedBatch,
    ctx=None,
    ratio: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    seed: int = 0,
) -> torch.Tensor:
    """PPO clip with the selected tokens detached (loss and gradient 0); [T] -> [T]."""
    ratio_t = torch.exp(logp - old_logp)
    loss = torch.maximum(-ratio_t * adv, -torch.clamp(ratio_t, 1 - clip_low, 1 + clip_high) * adv)
    return loss * (~clip_cov_selected(batch, cov_low, cov_high)).to(logp.dtype)


def _clip_cov_metrics(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    *,
    batch,
    ctx=None,
    ratio=2e-4,
    cov_low=1.0,
    cov_high=5.0,
    seed=0,
):
    """Share of loss tokens detached by the covariance rule."""
    return {"selected_frac": clip_cov_selected(batch, cov_low, cov_high).to(logp.dtype)}


def prepare_kl_cov(
    batch: PackedBatch, dp_group: Any, state: Any = None, *, ratio: float = 2e-4, **_
) -> PackedBatch:
    """extras: global means and τ, the k-th largest covariance of the global batch, k = max(⌊ratio·N⌋, 1)."""
    _check(ratio)
    means, n_tok = global_means(batch, dp_group)
    means = _per_seq(batch, means)
    cov = covariance(batch, means)[batch.loss_mask.bool()]
    k = max(int(ratio * n_tok), 1)
    local = torch.full((k,), -torch.inf, dtype=torch.float64)
    top = torch.topk(cov, min(k, cov.numel())).values
    local[: top.numel()] = top
    tau = (
        torch.topk(torch.cat(comm.all_gather(local, dp_group)), k).values[-1]
        if n_tok
        else torch.tensor(torch.inf)
    )
    extras = {MEANS: means, TAU: torch.full((batch.num_seqs,), float(tau), dtype=torch.float64)}
    return dataclasses.replace(batch, extras={**batch.extras, **extras})


def kl_cov_selected(batch: PackedBatch) -> torch.Tensor:
    """bool [T]: loss tokens whose covariance is at least the global threshold τ."""
    _need(batch, MEANS, TAU)
    cov = covariance(batch, batch.extras[MEANS])
    return batch.loss_mask.bool() & (cov >= broadcast_to_tokens(batch.extras[TAU].double(), batch.cu_seqlens))


def kl_cov(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=None,
    clip_high=None,
    dual_clip=None,
    *,
    batch: PackedBatch,
    ctx=None,
    ratio: float = 2e-4,
    kl_coef: float = 1.0,
) -> torch.Tensor:
    """−A·r + β·|logp − old| on the selected tokens (no clip); [T] -> [T]."""
    d = logp - old_logp
    return -adv * torch.exp(d) + kl_coef * d.abs() * kl_cov_selected(batch).to(logp.dtype)


def _kl_cov_metrics(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=None,
    clip_high=None,
    dual_clip=None,
    *,
    batch,
    ctx=None,
    ratio=2e-4,
    kl_coef=1.0,
):
    """Share of loss tokens under the KL penalty."""
    return {"selected_frac": kl_cov_selected(batch).to(logp.dtype)}


POLICY_LOSSES.add(
    "clip_cov",
    clip_cov,
    PartInfo(
        batch_inputs=("old_logprobs",),
        make_state=_make_draws,
        prepare=prepare_clip_cov,
        token_metrics=_clip_cov_metrics,
        needs_context=True,
    ),
)
POLICY_LOSSES.add(
    "kl_cov",
    kl_cov,
    PartInfo(
        batch_inputs=("old_logprobs",),
        prepare=prepare_kl_cov,
        token_metrics=_kl_cov_metrics,
        needs_context=True,
    ),
)

CLIP_COV = MethodSpec(
    name="clip_cov",
    summary="Clip-Cov: PPO clip, tokens of high advantage/log-prob covariance detached at random",
    provenance="code",
    config={"objective": {"policy_loss": "clip_cov"}},
)
KL_COV = MethodSpec(
    name="kl_cov",
    summary="KL-Cov: unclipped surrogate, |log-ratio| penalty on the top-covariance tokens",
    provenance="code",
    config={"objective": {"policy_loss": "kl_cov"}},
)
