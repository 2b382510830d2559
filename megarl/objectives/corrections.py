"""Train/rollout mismatch corrections: detached per-token multipliers of the policy loss.

``fn(old_logp, rollout_logp, mask, cu_seqlens, low, high) -> [T]``; formulas in reference/corrections.py.
The token-level ones and the rejections equal plain IS, w = exp(old_logp - rollout_logp), when no
threshold triggers; ``seq_tis`` equals sequence-level IS, the product of w over the sequence.
Every rejection (``mis``, ``icepop``, ``seq_geo_mask``, the k-criteria) is ``w · keep`` with its
keep mask in ``CRITERIA``, so criteria chain (``correction_chain``: a product of keeps).
"""

from __future__ import annotations

import torch

from megarl.ops.segments import broadcast_to_tokens, segment_masked_mean, segment_sum, token_to_seq
from megarl.registry import Registry

CORRECTIONS: Registry = Registry("mismatch_correction")
# criterion name -> keep(old_logp, rollout_logp, mask, cu_seqlens, low, high) -> bool [T]
CRITERIA: dict = {}


def _w(old_logp, rollout_logp):
    return torch.exp(old_logp - rollout_logp).detach()


@CORRECTIONS.register("none")
def none(old_logp, rollout_logp, mask, cu_seqlens, low, high):
    return torch.ones_like(old_logp)


@CORRECTIONS.register("tis")
def tis(old_logp, rollout_logp, mask, cu_seqlens, low, high):
    return torch.clamp(_w(old_logp, rollout_logp), max=high)


def _keep_mis(old_logp, rollout_logp, mask, cu_seqlens, low, high):
    return _w(old_logp, rollout_logp) <= high


def _keep_icepop(old_logp, rollout_logp, mask, cu_seqlens, low, high):
    w = _w(old_logp, rollout_logp)
    return (w >= low) & (w <= high)


def _keep_seq_geo(old_logp, rollout_logp, mask, cu_seqlens, low, high):
    rho = torch.exp(segment_masked_mean((old_logp - rollout_logp).detach(), mask, cu_seqlens))
    return broadcast_to_tokens(((rho >= low) & (rho <= high)).to(old_logp.dtype), cu_seqlens) > 0


@CORRECTIONS.register("seq_tis")
def seq_tis(old_logp, rollout_logp, mask, cu_seqlens, low, high):
    """Sequence-level truncated IS: min(prod_t w_t, high) on every token of the sequence."""
    log_rho = segment_sum((old_logp - rollout_logp).detach() * mask.to(old_logp.dtype), cu_seqlens)
    return broadcast_to_tokens(torch.clamp(torch.exp(log_rho), max=high), cu_seqlens)


def _divergence(kind: str, old_logp, rollout_logp):
    """Per-token estimate of KL(pi_rollout || pi_old) from samples of the rollout: k1 = -log w,
    k2 = (log w)^2 / 2, k3 = w - 1 - log w."""
    r = (old_logp - rollout_logp).detach()
    if kind == "k1":
        return -r
    if kind == "k2":
        return 0.5 * r * r
    return torch.exp(r) - 1 - r


def _token_rejection(kind: str):
    def fn(old_logp, rollout_logp, mask, cu_seqlens, low, high):
        return _divergence(kind, old_logp, rollout_logp) <= high

    fn.__doc__ = f"Token rejection on {kind}: keep where {kind} <= high."
    return fn


def _seq_rejection(stat: str, kind: str):
    def fn(old_logp, rollout_logp, mask, cu_seqlens, low, high):
        m = mask.to(old_logp.dtype)
        k = _divergence(kind, old_logp, rollout_logp) * m
        if stat == "sum":
            value = segment_sum(k, cu_seqlens)
        elif stat == "mean":
            value = segment_masked_mean(k, m, cu_seqlens)
        else:  # max over the response tokens (k2, k3 >= 0, so masked-out zeros never win)
            seq = token_to_seq(cu_seqlens).to(k.device)
            value = torch.zeros(cu_seqlens.numel() - 1, dtype=k.dtype, device=k.device)
            value = value.scatter_reduce(0, seq, k, "amax", include_self=True)
        bound = value.abs() if kind == "k1" else value  # k1 sums can be negative: |.| <= high
        return broadcast_to_tokens((bound <= high).to(old_logp.dtype), cu_seqlens) > 0

    fn.__doc__ = f"Sequence rejection on the {stat} of {kind} over its response tokens: keep where <= high."
    return fn


def _rejecting(keep_fn):
    def fn(old_logp, rollout_logp, mask, cu_seqlens, low, high):
        keep = keep_fn(old_logp, rollout_logp, mask, cu_seqlens, low, high)
        return _w(old_logp, rollout_logp) * keep.to(old_logp.dtype)

    fn.__doc__ = f"w · keep, {keep_fn.__doc__ or keep_fn.__name__}"
    return fn


REJECTIONS: tuple[str, ...] = (
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
CRITERIA.update(mis=_keep_mis, icepop=_keep_icepop, seq_geo_mask=_keep_seq_geo)
for _name in REJECTIONS:
    _parts = _name.split("_")
    CRITERIA[_name] = (
        _token_rejection(_parts[1]) if _parts[0] == "token" else _seq_rejection(_parts[1], _parts[2])
    )
for _name, _keep in CRITERIA.items():
    CORRECTIONS.add(_name, _rejecting(_keep))
