"""AMRP: online aggregation weights of K reward dimensions (formula: reference/reward_shaping.py).

``AMRP(**knobs)(rewards [B, K], dp_group=None) -> R [B]`` updates the weights from this step's
batch statistics and returns the scalar rewards. Batch statistics (per-dimension sums, sums of
squares, counts, min, max) are all-reduced over ``dp_group``, so every data-parallel rank holds the
same replicated weights. The weights are buffers: no gradient flows through them.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.ops import comm
from megarl.plugin.rounds import RolloutRound, RoundResult
from megarl.plugin.spec import MethodSpec
from megarl.rewards.shaping.base import RoundShaper
from megarl.rewards.shaping.registry import REWARD_SHAPERS


def floor_weights(w: torch.Tensor, w_min: float) -> torch.Tensor:
    """Raise entries below ``w_min`` to it and rescale the rest so the sum stays 1 (repeated until
    none is below); the identity on weights already >= w_min."""
    w = w.clone()
    fixed = torch.zeros_like(w, dtype=torch.bool)
    for _ in range(w.numel()):
        low = (w < w_min) & ~fixed
        if not bool(low.any()):
            break
        fixed |= low
        w[fixed] = w_min
        w[~fixed] = w[~fixed] / w[~fixed].sum() * (1 - w_min * int(fixed.sum()))
    return w


@REWARD_SHAPERS.register("amrp")
class AMRP(RoundShaper):
    """Adaptive multi-reward projection; see the module docstring. ``weights``: current w [K]."""

    def __init__(
        self,
        beta: float = 0.9,
        window: int = 10,
        a: float = 1.0,
        b: float = 1.0,
        tau: float = 0.5,
        eta: float = 0.1,
        w_min: float = 0.02,
        g0: float = 0.01,
        delta: float = 1e-8,
        r_min: list | None = None,
        r_max: list | None = None,
        normalise: str = "minmax",
        initial_weights: list | None = None,
    ):
        if not 0 <= eta <= 1:
            raise ValueError(f"amrp: eta={eta} must be in [0, 1]")
        if tau <= 0 or g0 <= 0 or window < 1:
            raise ValueError(f"amrp: tau={tau}, g0={g0} must be > 0 and window={window} >= 1")
        if (r_min is None) != (r_max is None):
            raise ValueError("amrp: give both r_min and r_max, or neither")
        if normalise not in ("minmax", "z"):
            raise ValueError(f"amrp: normalise={normalise!r}; allowed: minmax, z")
        self.beta, self.window, self.a, self.b, self.tau, self.eta = beta, window, a, b, tau, eta
        self.w_min, self.g0, self.delta, self.normalise = w_min, g0, delta, normalise
        self.bounds = (
            None
            if r_min is None
            else (torch.tensor(r_min, dtype=torch.float64), torch.tensor(r_max, dtype=torch.float64))
        )
        self.initial = None if initial_weights is None else torch.tensor(initial_weights, dtype=torch.float64)
        self.state: dict[str, Any] = {}

    @property
    def weights(self) -> torch.Tensor | None:
        return self.state.get("w")

    def _batch_stats(self, r: torch.Tensor, dp_group: Any):
        K = r.shape[1]
        sums = torch.cat([r.sum(0), (r * r).sum(0), torch.tensor([float(r.shape[0])], dtype=torch.float64)])
        lo, hi = r.min(0).values.clone(), r.max(0).values.clone()
        if dp_group is not None:
            comm.all_reduce(sums, "sum", dp_group)
            comm.all_reduce(lo, "min", dp_group)
            comm.all_reduce(hi, "max", dp_group)
        n = sums[-1]
        mu = sums[:K] / n
        var = (sums[K : 2 * K] / n - mu * mu).clamp(min=0)
        return mu, var, lo, hi

    @torch.no_grad()
    def __call__(self, rewards: torch.Tensor, dp_group: Any = None) -> torch.Tensor:
        """Update the weights with this step's rewards [B, K] and return R [B] (float64)."""
        if rewards.dim() != 2:
            raise ValueError(f"amrp: rewards must be [B, K], got {tuple(rewards.shape)}")
        r = rewards.detach().double()
        K = r.shape[1]
        st = self.state
        mu, var, blo, bhi = self._batch_stats(r, dp_group)
        if self.bounds is not None:
            lo, hi = self.bounds
        else:
            lo, hi = (
                (blo, bhi) if "lo" not in st else (torch.minimum(blo, st["lo"]), torch.maximum(bhi, st["hi"]))
            )
            st["lo"], st["hi"] = lo, hi
        if "w" not in st:
            w0 = self.initial if self.initial is not None else torch.full((K,), 1.0 / K, dtype=torch.float64)
            if w0.numel() != K or abs(float(w0.sum()) - 1) > 1e-9 or bool((w0 < self.w_min).any()):
                raise ValueError(
                    f"amrp: initial_weights {w0.tolist()} must be {K} values >= w_min summing to 1"
                )
            st["w"], st["hist"] = w0.clone(), torch.zeros(0, K, dtype=torch.float64)
        if "prev" in st:
            st["ema_d"] = self.beta * st["ema_d"] + (1 - self.beta) * (mu - st["prev"]).abs()
            st["ema_m"] = self.beta * st["ema_m"] + (1 - self.beta) * mu.abs()
        else:
            st["ema_d"], st["ema_m"] = torch.zeros(K, dtype=torch.float64), mu.abs()
        rng = hi - lo
        s = (hi - mu) / (rng + self.delta)
        v = st["ema_d"] / (st["ema_m"] + self.delta)
        hist = st["hist"]
        if hist.shape[0]:
            lag = min(self.window, hist.shape[0])
            g = (mu - hist[-lag]) / (lag * rng + self.delta)
        else:
            g = torch.zeros(K, dtype=torch.float64)
        q = torch.exp(-g.clamp(min=0) / self.g0)
        z = s * (1 + self.a * v + self.b * q)
        st["w"] = floor_weights(
            (1 - self.eta) * st["w"] + self.eta * torch.softmax(z / self.tau, 0), self.w_min
        )
        st["prev"] = mu
        st["hist"] = torch.cat([hist, mu.unsqueeze(0)])[-self.window :]
        if self.normalise == "minmax":
            span = bhi - blo
            norm = torch.where(
                span > 0, (r - blo) / torch.where(span > 0, span, torch.ones_like(span)), torch.zeros_like(r)
            )
        else:
            sd = var.sqrt()
            norm = torch.where(
                (bhi > blo) & (sd > 0),
                (r - mu) / torch.where(sd > 0, sd, torch.ones_like(sd)),
                torch.zeros_like(r),
            )
        return norm @ st["w"]

    async def shape_round(self, r: RolloutRound, env: Any) -> RoundResult:
        """AMRP over the round's reward vector (the named dimensions, in config order)."""
        from megarl.rewards.shaping.processor import dims_matrix

        shaped = self(dims_matrix(r))
        return RoundResult(
            shaped, metrics={f"shaping/amrp/w/{k}": float(self.weights[i]) for i, k in enumerate(r.weights)}
        )

    def state_dict(self) -> dict:
        return {k: v.clone() for k, v in self.state.items()}

    def load_state_dict(self, state: dict) -> None:
        self.state = {k: v.clone() for k, v in state.items()}


SPEC = MethodSpec(
    name="amrp",
    summary="AMRP: adaptive weights over reward dimensions",
    provenance="reconstructed",
    config={"reward": {"shaping": {"name": "amrp"}}},
)
