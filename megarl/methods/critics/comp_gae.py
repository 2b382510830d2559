"""CompPO / Comp-GAE: GAE whose discount is gated per token by the behaviour policy's own attention
concentration (formulas: reference/critics.py ``attention_concentration``, ``comp_gate``,
``comp_gae``).

- ``attention_concentration`` (a learner-stage input): per token, κ of the policy's attention row
  that predicted it (query position t − 1, like ``old_logprobs[t]``), averaged over every head and
  the selected layers, detached: ``entropy``: κ = 1 − H(a)/log(n) (n keys of the query),
  ``max``: κ = max_j a_j. Stored in ``batch.token_extras['attention_concentration']``.
- ``comp_gae`` (an advantage estimator): κ standardised over the batch's loss tokens, the gate
  g = g_min + (g_max − g_min)·σ(slope·κ̃ + offset), then δ_t = r_t + γ g_t V_{t+1} − V_t and
  Â_t = δ_t + γ λ g_t Â_{t+1}; writes ``batch.returns`` = Â + V (the critic's targets).
  ``shuffle: true`` permutes the gates within each response (the ablation: same gate values, no
  alignment with the attention).

The values come from the ``values`` input: the Megatron critic, or (``inputs.values.model: trunk``,
TAC) a head on the policy's own detached hidden states (megarl/methods/critics/trunk.py).

Provenance: reconstructed. The abstract gives only a bounded gate from attention concentration used
in both the bootstrap and the trace, reducing to GAE for a constant gate; the statistic, the batch
standardisation and the sigmoid form and defaults are reconstructions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, _compact, token_rewards
from megarl.batch import PackedBatch
from megarl.methods.critics.probe import attention_entropy_sums
from megarl.ops.segments import token_to_seq
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

CONCENTRATION = "attention_concentration"
STATISTICS = ("entropy", "max")


@dataclass
class ConcentrationKnobs(Knobs):
    """statistic: entropy | max; layers: global 0-based layer indices to average (None: all)."""

    statistic: str = "entropy"
    layers: list | None = None

    def check(self) -> None:
        """A known statistic; a non-empty list of layer indices."""
        if self.statistic not in STATISTICS:
            raise ValueError(f"statistic={self.statistic!r}; known: {', '.join(STATISTICS)}")
        if self.layers is not None and (
            not self.layers or not all(isinstance(i, int) and i >= 0 for i in self.layers)
        ):
            raise ValueError(f"layers={self.layers!r} must be a non-empty list of layer indices >= 0")


def concentration_from_sums(
    sums: torch.Tensor, count: int, cu_seqlens: torch.Tensor, statistic: str
) -> torch.Tensor:
    """κ per token [T] aligned like ``logprobs`` (token t: the query at t − 1; first tokens 0) from
    per-position sums of the statistic over ``count`` (head, layer) pairs."""
    mean = sums / max(count, 1)
    T = sums.numel()
    seq = token_to_seq(cu_seqlens)
    n_keys = (torch.arange(T) - cu_seqlens[seq] + 1).double()  # keys seen by the query at position p
    if statistic == "max":
        kappa = mean
    else:
        kappa = torch.where(n_keys > 1, 1.0 - mean / torch.log(n_keys.clamp(min=2.0)), torch.ones_like(mean))
    out = torch.zeros(T, dtype=torch.float64)
    out[1:] = kappa[:-1]
    out[cu_seqlens[:-1]] = 0.0
    return out


class ConcentrationPass:
    """A ``LearnerPass``: one forward of the policy with hooks on its attention (collective)."""

    def __init__(self, policy: Any, knobs: ConcentrationKnobs):
        self.policy, self.knobs = policy, knobs

    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """``batch.token_extras['attention_concentration']`` [T] float64 (detached)."""
        sums, count = attention_entropy_sums(
            self.policy, batch, micro_batches, self.knobs.layers, self.knobs.statistic
        )
        kappa = concentration_from_sums(sums, count, batch.cu_seqlens, self.knobs.statistic)
        batch.token_extras[CONCENTRATION] = kappa
        m = batch.loss_mask.bool()
        sel = kappa[m]
        return {
            "comp/kappa_mean": float(sel.mean()) if sel.numel() else 0.0,
            "comp/kappa_std": float(sel.std()) if sel.numel() > 1 else 0.0,
        }


def comp_gate(
    kappa: torch.Tensor,
    mask: torch.Tensor,
    g_min: float = 0.9,
    g_max: float = 1.0,
    slope: float = 1.0,
    offset: float = 0.0,
) -> torch.Tensor:
    """The retention gate [T] from κ [T]: standardised over the masked-in tokens, squashed into
    [g_min, g_max] (reference/critics.py ``comp_gate``). Detached."""
    k = kappa.detach().double()
    sel = k[mask.bool()]
    std = sel.std() if sel.numel() > 1 else torch.zeros((), dtype=torch.float64)
    z = (k - sel.mean()) / std if float(std) > 0 else torch.zeros_like(k)
    return g_min + (g_max - g_min) * torch.sigmoid(slope * z + offset)


def shuffled_within_sequences(x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, seed: int):
    """``x`` [T] with its masked-in entries permuted at random within each sequence (seeded)."""
    g = torch.Generator().manual_seed(seed)
    out = x.clone()
    for b in range(cu_seqlens.numel() - 1):
        idx = mask[int(cu_seqlens[b]) : int(cu_seqlens[b + 1])].nonzero().flatten() + int(cu_seqlens[b])
        out[idx] = x[idx[torch.randperm(idx.numel(), generator=g)]]
    return out


def gated_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    gate: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Comp-GAE by reverse scan over the masked-in tokens of each sequence, vectorised over
    sequences: δ_t = r_t + γ g_t V_{t+1} − V_t, Â_t = δ_t + γ λ g_t Â_{t+1}.
    rewards, values, gate, mask: [T] -> (advantages [T], returns Â + V [T]), 0 off the mask."""
    tok, s, col, counts, N = _compact(rewards, mask, cu_seqlens)
    B = counts.numel()
    dt = values.dtype
    r = torch.zeros(B, N + 1, dtype=dt)
    v = torch.zeros(B, N + 1, dtype=dt)
    gt = torch.zeros(B, N + 1, dtype=dt)
    r[s, col] = rewards[tok].to(dt)
    v[s, col] = values[tok]
    gt[s, col] = gate[tok].to(dt)
    a = torch.zeros(B, N + 1, dtype=dt)
    for t in range(N - 1, -1, -1):
        valid = (t < counts).to(dt)
        delta = r[:, t] + gamma * gt[:, t] * v[:, t + 1] - v[:, t]
        a[:, t] = (delta + gamma * lam * gt[:, t] * a[:, t + 1]) * valid
    adv = torch.zeros_like(values)
    adv[tok] = a[s, col]
    return adv, (adv + values) * mask.to(dt)


def _comp_gae(
    batch: PackedBatch,
    gamma: float = 1.0,
    lam: float = 0.95,
    g_min: float = 0.9,
    g_max: float = 1.0,
    slope: float = 1.0,
    offset: float = 0.0,
    shuffle: bool = False,
    shuffle_seed: int = 0,
) -> torch.Tensor:
    """Comp-GAE over ``batch.values`` gated by the attention concentration; writes ``batch.returns``."""
    if not 0.0 <= g_min <= g_max <= 1.0:
        raise ValueError(f"advantage.g_min={g_min}, advantage.g_max={g_max}: need 0 <= g_min <= g_max <= 1")
    if batch.values is None:
        raise ValueError("advantage_estimator=comp_gae needs the batch field 'values'")
    kappa = batch.token_extras.get(CONCENTRATION)
    if kappa is None:
        raise ValueError(
            "advantage_estimator=comp_gae needs token_extras['attention_concentration'] "
            "(the attention_concentration input)"
        )
    m = batch.loss_mask.double()
    gate = comp_gate(kappa, m, g_min, g_max, slope, offset)
    if shuffle:
        gate = shuffled_within_sequences(gate, m, batch.cu_seqlens, shuffle_seed)
    adv, ret = gated_gae(token_rewards(batch), batch.values.double(), gate, m, batch.cu_seqlens, gamma, lam)
    batch.returns = ret.to(batch.values.dtype)
    return adv


ADVANTAGE_ESTIMATORS.add("comp_gae", _comp_gae, PartInfo(batch_inputs=("values", CONCENTRATION)))

ATTENTION_CONCENTRATION = register_provider(
    InputProvider(
        (CONCENTRATION,),
        "learner",
        lambda ctx, names: ConcentrationPass(ctx.policy, ctx.knobs),
        knobs=ConcentrationKnobs,
        summary="per-token concentration of the policy's own attention (1 - entropy/log n, or max), detached",
    )
)

SPEC = MethodSpec(
    name="comppo",
    summary="CompPO: GAE gated per token by the policy's attention concentration (Comp-GAE), PPO clip",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "comp_gae", "gamma": 1.0, "lam": 0.95},
        "objective": {"policy_loss": "ppo"},
    },
)
