"""The output layer fused with the per-token softmax statistics: logits never exist in full.

Each tensor-parallel rank holds the rows ``[rank·V/tp, (rank+1)·V/tp)`` of the output weight
``weight: [V/tp, H]`` and the same final hidden states ``hidden: [T, H]``. The ops here compute, in
token chunks of ``chunk_tokens`` rows, this rank's logits ``hidden[s:e] @ weight.T`` (``[c, V/tp]``,
in the weight's dtype, as the output layer would), upcast each chunk to the accumulation dtype and
reduce it to per-token statistics; the chunk is then dropped. Backward recomputes each chunk's
logits from the saved ``hidden`` and ``weight`` and turns the chunk's logit gradient into the
gradients of both at once. So memory beyond the inputs and their gradients is a few ``[c, V/tp]``
temporaries, never ``[T, V/tp]``; the price is one more ``[T, H] x [H, V/tp]`` product (the
recomputation) than an unfused output layer.

Collectives: as ``megarl.ops.vocab_parallel``: one MAX and one SUM all-reduce of small ``[k, T]``
tensors per forward, whatever the number of chunks; backward adds one SUM all-reduce of the
``[T, H]`` hidden gradient (each rank's vocab shard contributes a part), unless the caller reduces
it itself (``reduce_hidden_grad=False``, e.g. behind megatron's sequence-parallel gather, whose
backward is a reduce-scatter).

Results equal ``megarl.ops.vocab_parallel`` applied to ``hidden @ weight.T`` up to the rounding of
the chunked products.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.ops import comm
from megarl.ops.vocab_parallel import _acc_dtype, _chunks, _global_lse


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, s: int, e: int, acc: torch.dtype
) -> torch.Tensor:
    """This rank's logits of tokens ``[s, e)`` in the accumulation dtype: ``[e-s, V/tp]``."""
    return (hidden[s:e] @ weight.t()).to(acc)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_v a[t, v]·b[t, v] per row without a third ``[c, V]`` temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class _FusedLogprobEntropy(torch.autograd.Function):
    """log p(target) and entropy from hidden states and a vocab shard of the output weight."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, group, chunk, with_entropy, reduce_hidden_grad):
        T, vl = hidden.shape[0], weight.shape[0]
        acc = _acc_dtype(weight)
        v0 = comm.rank(group) * vl
        in_shard = (targets >= v0) & (targets < v0 + vl)
        local_t = torch.where(in_shard, targets - v0, torch.zeros_like(targets))
        lmax = torch.empty(T, dtype=acc, device=hidden.device)
        partial = torch.zeros(2, T, dtype=acc, device=hidden.device)  # Σ e^(z-m), Σ e^(z-m)·(z-m)
        tgt = torch.zeros(1, T, dtype=acc, device=hidden.device)  # target logit (on its owner rank)
        for s, e in _chunks(T, chunk, vl):
            z = _chunk_logits(hidden, weight, s, e, acc)
            tz = z.gather(-1, local_t[s:e].unsqueeze(-1)).squeeze(-1)
            tgt[0, s:e] = torch.where(in_shard[s:e], tz, torch.zeros_like(tz))
            m = z.max(-1).values
            z.sub_(m.unsqueeze(-1))  # z - m, in place
            ez = torch.exp(z)
            lmax[s:e] = m
            partial[0, s:e] = ez.sum(-1)
            if with_entropy:
                partial[1, s:e] = _row_dot(ez, z)
            del z, ez
        if with_entropy:  # Σ e^(z-m)·z = Σ e^(z-m)·(z-m) + m·Σ e^(z-m): rescalable like row 0
            partial[1] += lmax * partial[0]
        gmax, sums, tgt = _global_lse(lmax, partial, group, unscaled=tgt)
        lse = gmax + torch.log(sums[0])
        logp = tgt[0] - lse
        if with_entropy:
            spz = sums[1] / sums[0]  # Σ_v p_v z_v
            ent = lse - spz
        else:
            spz = torch.zeros_like(lse)
            ent = torch.zeros_like(lse)
        ctx.save_for_backward(hidden, weight, local_t, in_shard, lse, spz)
        ctx.group, ctx.chunk, ctx.with_entropy = group, chunk, with_entropy
        ctx.reduce_hidden_grad = reduce_hidden_grad
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, local_t, in_shard, lse, spz = ctx.saved_tensors
        acc = lse.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.to(acc)
        g_ent = g_ent.to(acc) if (ctx.with_entropy and g_ent is not None) else None
        grad_h = torch.zeros_like(hidden) if need_h else None
        # the weight gradient accumulates over chunks: in fp32 for a lower-precision weight
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for s, e in _chunks(hidden.shape[0], ctx.chunk, weight.shape[0]):
            z = _chunk_logits(hidden, weight, s, e, acc)
            p = torch.sub(z, lse[s:e].unsqueeze(-1)).exp_()  # two [c, V/tp] temporaries at most
            # dlogp/dz_j = 1[j = target] - p_j;  dH/dz_j = -p_j (z_j - Σ_v p_v z_v)
            if g_ent is not None:  # p·(-g_ent·z + g_ent·Σpz - g_logp), one pass to form the factor
                ge = g_ent[s:e].unsqueeze(-1)
                g = p.mul_(z.mul_(-ge).add_(ge * spz[s:e].unsqueeze(-1) - g_logp[s:e].unsqueeze(-1)))
            else:
                g = p.mul_(-g_logp[s:e].unsqueeze(-1))
            del z
            rows = in_shard[s:e].nonzero().flatten()
            g[rows, local_t[s:e][rows]] += g_logp[s:e][rows]
            gw = g.to(weight.dtype)
            if grad_h is not None:
                grad_h[s:e] = gw @ weight
            if grad_w is not None and gw.dtype == acc:
                grad_w.addmm_(gw.t(), hidden[s:e])
            elif grad_w is not None:  # bf16/fp16 product, accumulated in fp32
                grad_w += gw.t() @ hidden[s:e]
            del g, gw
        if grad_h is not None and ctx.reduce_hidden_grad:
            comm.all_reduce(grad_h, "sum", ctx.group)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def fused_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    tp_group: Any = None,
    chunk_tokens: int | None = None,
    with_entropy: bool = True,
    reduce_hidden_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) and the full-vocabulary entropy of the logits ``hidden @ weight.T``, chunked.

    hidden: [T, H], the same on every rank of ``tp_group``; weight: [V/tp, H], this rank's rows of
    the output weight (rank r holds vocabulary ids ``[r·V/tp, (r+1)·V/tp)``); targets: [T] global
    ids. Returns (logprobs [T], entropy [T]) in fp32 (fp64 for an fp64 weight), the same on every
    rank, differentiable w.r.t. ``hidden`` and ``weight``. ``chunk_tokens=None`` picks chunks of
    about 2**24 logits. ``reduce_hidden_grad=False`` leaves each rank's own part of the hidden
    gradient (the caller sums it over ``tp_group``).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fused_logprobs_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
            "must be [T, H] and [V/tp, H]"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"fused_logprobs_entropy: targets {tuple(targets.shape)} for {hidden.shape[0]} tokens"
        )
    return _FusedLogprobEntropy.apply(
        hidden, weight, targets.long(), tp_group, chunk_tokens, with_entropy, reduce_hidden_grad
    )


@torch.no_grad()
def fused_topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    tp_group: Any = None,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of ``softmax(hidden @ weight.T)`` and their log-probabilities,
    chunked (no gradient): hidden [T, H] (same on every rank), weight [V/tp, H] (this rank's rows)
    -> (ids [T, k] int64 global ids, logprobs [T, k] fp32; fp64 for an fp64 weight), sorted best
    first, the same on every rank. Ties go to the lower id, as ``vocab_parallel_topk`` on the logits.
    """
    T, vl = hidden.shape[0], weight.shape[0]
    acc = _acc_dtype(weight)
    v0 = comm.rank(tp_group) * vl
    kk = min(k, vl)
    vals = torch.empty(T, kk, dtype=acc, device=hidden.device)
    ids = torch.empty(T, kk, dtype=torch.long, device=hidden.device)
    lmax = torch.empty(T, dtype=acc, device=hidden.device)
    partial = torch.zeros(1, T, dtype=acc, device=hidden.device)
    for s, e in _chunks(T, chunk_tokens, vl):
        z = _chunk_logits(hidden, weight, s, e, acc)
        top = torch.topk(z, kk, dim=-1, sorted=True)
        vals[s:e], ids[s:e] = top.values, top.indices + v0
        m = z.max(-1).values
        lmax[s:e] = m
        partial[0, s:e] = z.sub_(m.unsqueeze(-1)).exp_().sum(-1)
        del z
    gmax, sums, _ = _global_lse(lmax, partial, tp_group)
    lse = gmax + torch.log(sums[0])
    all_vals = torch.cat(comm.all_gather(vals, tp_group), -1)  # [T, tp·kk], ranks in id order
    all_ids = torch.cat(comm.all_gather(ids, tp_group), -1)
    order = torch.sort(-all_vals, dim=-1, stable=True).indices[:, :k]  # stable: lower id first on ties
    return all_ids.gather(-1, order), all_vals.gather(-1, order) - lse.unsqueeze(-1)
