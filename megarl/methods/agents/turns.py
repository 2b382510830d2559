"""Turn structure and turn weights of multi-turn batches, shared by the turn-credit methods
(TASPO, AgentOPSD, TRIAL).

Turn k of sequence i is its k-th ``turn_spans`` entry with role ``assistant``; a batch without
``turn_spans`` (single-turn rollouts) has one turn per sequence, its response. A token is
*eligible* when it is a loss token inside a turn (model tokens; observations are out of the loss).
Turn quantities are [B, K] tensors (K: the most turns of any sequence), ``n`` [B, K] the eligible
tokens of each turn; a turn with ``n = 0`` (padding, or every token masked) carries no weight.
"""

from __future__ import annotations

import torch

from megarl.batch import PackedBatch


def token_turns(batch: PackedBatch, role: str = "assistant") -> tuple[torch.Tensor, int]:
    """([T] long: the turn index of each eligible token, -1 elsewhere; K: turns per sequence, at most)."""
    turn = torch.full((batch.num_tokens,), -1, dtype=torch.long)  # spans are host data
    K = 1
    for i in range(batch.num_seqs):
        start = int(batch.cu_seqlens[i])
        if batch.turn_spans is None:
            spans = [(int(batch.prompt_lens[i]), int(batch.seq_lens[i]))]
        else:
            spans = [(s, e) for s, e, r in batch.turn_spans[i] if r == role]
        K = max(K, len(spans))
        for k, (s, e) in enumerate(spans):
            turn[start + s : start + e] = k
    turn[batch.loss_mask.cpu() <= 0] = -1
    return turn.to(batch.loss_mask.device), K


def turn_sums(x: torch.Tensor, turn: torch.Tensor, seq: torch.Tensor, num_seqs: int, K: int) -> torch.Tensor:
    """Per-turn sums of a per-token ``x`` [T] over the eligible tokens: [B, K] float64."""
    on = turn >= 0
    flat = torch.zeros(num_seqs * K, dtype=torch.float64, device=x.device)
    flat.index_add_(0, seq[on] * K + turn[on], x[on].double())
    return flat.view(num_seqs, K)


def turn_counts(turn: torch.Tensor, seq: torch.Tensor, num_seqs: int, K: int) -> torch.Tensor:
    """[B, K] eligible tokens per turn (float64)."""
    return turn_sums(torch.ones_like(turn, dtype=torch.float64), turn, seq, num_seqs, K)


def on_turn_tokens(per_turn: torch.Tensor, turn: torch.Tensor, seq: torch.Tensor, fill: float = 0.0):
    """A [B, K] turn quantity on each eligible token; ``fill`` elsewhere: [T] float64."""
    out = torch.full(turn.shape, fill, dtype=torch.float64, device=turn.device)
    on = turn >= 0
    out[on] = per_turn[seq[on], turn[on]].double()
    return out


def mean_preserving_weights(
    w_hat: torch.Tensor, n: torch.Tensor, lo: float = 0.25, hi: float = 2.0
) -> torch.Tensor:
    """w_k = clip(c · ŵ_k, lo, hi) with the scale c (one per sequence) that makes the
    token-weighted mean Σ_k n_k w_k / Σ_k n_k exactly 1. [B, K] -> [B, K] float64; 1 where n = 0.

    ŵ > 0 and lo <= 1 <= hi (finite) guarantee a solution: f(c) = Σ n clip(c ŵ, lo, hi) is
    continuous, nondecreasing and piecewise linear in c with breakpoints lo/ŵ_k, hi/ŵ_k; it is
    solved exactly on the segment between the two breakpoints that bracket Σ n. This is the fixed
    point of "normalise the mean to 1, clip to [lo, hi], repeat".
    """
    w_hat, n = w_hat.double(), n.double()
    valid = n > 0
    if bool((w_hat[valid] <= 0).any()):
        raise ValueError("mean_preserving_weights: every weight ŵ must be positive")
    safe = torch.where(valid, w_hat, torch.ones_like(w_hat))
    total = n.sum(1, keepdim=True)  # [B, 1]
    bps = torch.cat([lo / safe, hi / safe], 1)  # [B, 2K]
    bps = torch.where(torch.cat([valid, valid], 1), bps, torch.full_like(bps, float("nan")))

    def f(c: torch.Tensor) -> torch.Tensor:  # [B, M] scales -> [B, M] Σ n clip(c ŵ)
        w = torch.clamp(c.unsqueeze(-1) * safe.unsqueeze(1), lo, hi)
        return (w * n.unsqueeze(1)).sum(-1)

    fb = f(torch.nan_to_num(bps, nan=0.0))
    ok = ~torch.isnan(bps)
    below = ok & (fb <= total)
    above = ok & (fb > total)
    inf = torch.full_like(bps, float("inf"))
    c_a = torch.where(below, bps, -inf).max(1).values  # the largest breakpoint with f <= N
    c_b = torch.where(above, bps, inf).min(1).values  # the smallest with f > N
    f_a = torch.where(below & (bps == c_a[:, None]), fb, -inf).max(1).values
    f_b = torch.where(above & (bps == c_b[:, None]), fb, inf).min(1).values
    has_b = torch.isfinite(c_b)
    t = torch.where(has_b, (total[:, 0] - f_a) / torch.where(has_b, f_b - f_a, 1.0), 0.0)
    c = torch.where(has_b, c_a + t * torch.where(has_b, c_b - c_a, 0.0), c_a)
    c = torch.where(valid.any(1), c, torch.ones_like(c))
    w = torch.clamp(c[:, None] * safe, lo, hi)
    return torch.where(valid, w, torch.ones_like(w))


def check_bounds(lam: float, w_lo: float, w_hi: float, where: str) -> None:
    """0 <= λ < 1 (positive ŵ) and 0 <= w_lo <= 1 <= w_hi < inf; errors name ``where``."""
    if not 0.0 <= lam < 1.0:
        raise ValueError(f"{where}.lam={lam} must be in [0, 1) (weights 1 ± λ stay positive)")
    if not (0.0 <= w_lo <= 1.0 <= w_hi < float("inf")):
        raise ValueError(f"{where}: bounds w_lo={w_lo}, w_hi={w_hi} need 0 <= w_lo <= 1 <= w_hi (finite)")


class TurnWeightStats:
    """An estimator's state that only reports the last batch's turn weights (nothing to checkpoint):
    ``adv/<name>_weight_dev`` (token-weighted mean |w − 1|), ``adv/<name>_weight_max`` and
    ``adv/turns_per_seq``."""

    def __init__(self, name: str):
        self.name, self.last = name, {}

    def record(self, w: torch.Tensor, n: torch.Tensor) -> None:
        """Keep the diagnostics of weights ``w`` [B, K] over turns with ``n`` [B, K] eligible tokens."""
        valid, total = n > 0, float(n.sum())
        self.last = {
            f"adv/{self.name}_weight_dev": float(((w - 1).abs() * n).sum()) / total if total else 0.0,
            f"adv/{self.name}_weight_max": float(w[valid].max()) if bool(valid.any()) else 1.0,
            "adv/turns_per_seq": float(valid.sum(1).double().mean()) if valid.numel() else 0.0,
        }

    def metrics(self) -> dict[str, float]:
        """The last batch's diagnostics."""
        return dict(self.last)

    def state_dict(self) -> dict:
        """Nothing to save."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""
