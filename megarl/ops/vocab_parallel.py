"""Softmax statistics of vocab-parallel logits without gathering the vocabulary.

Each tensor-parallel rank holds ``logits: [T, V/tp]``, the columns ``[rank·V/tp, (rank+1)·V/tp)``
of the full ``[T, V]`` logits. Every op here returns per-token results that are identical on all
ranks of ``tp_group`` and gives each rank the gradient of its own shard.

Memory: the logits are read in chunks of ``chunk_tokens`` rows, each upcast to the accumulation
dtype (fp32, or fp64 for fp64 input) on its own, so no full-size fp32 copy of ``[T, V/tp]``
exists. Backward recomputes the softmax chunk by chunk from saved per-token statistics and writes
the gradient straight into one tensor of the logits' dtype.

Collectives: a forward pass needs two all-reduces of small ``[k, T]`` tensors (MAX of the local
maxima, then one SUM of the rescaled partial sums), whatever the number of chunks.
Logits must be finite.
"""

from __future__ import annotations

import math
from typing import Any, overload

import torch

from megarl.ops import comm


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# Default token chunk: as many rows as fit in about 2**24 elements (64 MiB of fp32) per temporary.
CHUNK_ELEMENTS = 1 << 24


def _chunks(T: int, chunk: int | None, width: int = 1):
    chunk = max(int(chunk), 1) if chunk else max(CHUNK_ELEMENTS // max(width, 1), 1)
    for s in range(0, T, chunk):
        yield s, min(s + chunk, T)


def _vocab_range(logits: torch.Tensor, group: Any) -> tuple[int, int]:
    v = logits.shape[-1]
    start = comm.rank(group) * v
    return start, start + v


@overload
def _global_lse(
    local_max: torch.Tensor, partial: torch.Tensor, group: Any, unscaled: None = None
) -> tuple[torch.Tensor, torch.Tensor, None]: ...
@overload
def _global_lse(
    local_max: torch.Tensor, partial: torch.Tensor, group: Any, unscaled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
def _global_lse(
    local_max: torch.Tensor, partial: torch.Tensor, group: Any, unscaled: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Combine per-rank softmax partial sums into global ones with two all-reduces.

    local_max: [T]; partial: [k, T], row 0 is Σ exp(z - local_max), rows 1.. are Σ exp(z - local_max)·f(z);
    unscaled: [j, T] plain sums to add across ranks in the same collective (e.g. target logits).
    Returns (global max [T], partial summed and rescaled to the global max [k, T], unscaled summed).
    """
    gmax = comm.all_reduce(local_max.clone(), "max", group)
    rows = [partial * torch.exp(local_max - gmax).unsqueeze(0)]
    if unscaled is not None:
        rows.append(unscaled)
    both = torch.cat(rows, 0)
    comm.all_reduce(both, "sum", group)
    k = partial.shape[0]
    return gmax, both[:k], (both[k:] if unscaled is not None else None)


class _LogprobEntropy(torch.autograd.Function):
    """Target log-prob and (optionally) entropy of sharded logits, chunked, with custom backward."""

    @staticmethod
    def forward(ctx, logits, targets, group, chunk, with_entropy, inplace_backward=False):
        T = logits.shape[0]
        acc = _acc_dtype(logits)
        v0, v1 = _vocab_range(logits, group)
        in_shard = (targets >= v0) & (targets < v1)
        local_t = torch.where(in_shard, targets - v0, torch.zeros_like(targets))
        lmax = torch.empty(T, dtype=acc, device=logits.device)
        partial = torch.zeros(2, T, dtype=acc, device=logits.device)  # Σ e^(z-m), Σ e^(z-m)·z
        tgt = torch.zeros(1, T, dtype=acc, device=logits.device)  # target logit (on its owner rank)
        for s, e in _chunks(T, chunk, logits.shape[-1]):
            z = logits[s:e].to(acc)
            m = z.max(-1).values
            ez = torch.exp(z - m.unsqueeze(-1))
            lmax[s:e] = m
            partial[0, s:e] = ez.sum(-1)
            if with_entropy:
                partial[1, s:e] = (ez * z).sum(-1)
            tz = z.gather(-1, local_t[s:e].unsqueeze(-1)).squeeze(-1)
            tgt[0, s:e] = torch.where(in_shard[s:e], tz, torch.zeros_like(tz))
        gmax, sums, tgt = _global_lse(lmax, partial, group, unscaled=tgt)
        tgt = tgt[0]
        lse = gmax + torch.log(sums[0])
        logp = tgt - lse
        if with_entropy:
            spz = sums[1] / sums[0]  # Σ_v p_v z_v
            ent = lse - spz
        else:
            spz = torch.zeros_like(lse)
            ent = torch.zeros_like(lse)
        ctx.save_for_backward(logits, local_t, in_shard, lse, spz)
        ctx.chunk, ctx.with_entropy, ctx.inplace = chunk, with_entropy, inplace_backward
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, local_t, in_shard, lse, spz = ctx.saved_tensors
        acc = lse.dtype
        # in-place: the gradient overwrites the logits chunk by chunk (each chunk is read before it
        # is written), so backward allocates nothing of size [T, V/tp]
        grad = logits if ctx.inplace else torch.empty_like(logits)
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.to(acc)
        g_ent = g_ent if ctx.with_entropy else None
        for s, e in _chunks(logits.shape[0], ctx.chunk, logits.shape[-1]):
            z = logits[s:e].to(acc)
            p = torch.exp(z - lse[s:e].unsqueeze(-1))
            g = p * (-g_logp[s:e]).unsqueeze(-1)
            if g_ent is not None:
                # dH/dz_j = -p_j (z_j - Σ_v p_v z_v)
                g -= p * (z - spz[s:e].unsqueeze(-1)) * g_ent[s:e].to(acc).unsqueeze(-1)
            hit = in_shard[s:e]
            rows = hit.nonzero().flatten()
            g[rows, local_t[s:e][rows]] += g_logp[s:e][rows]
            grad[s:e] = g.to(grad.dtype)
        return grad, None, None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group: Any = None,
    chunk_tokens: int | None = None,
    with_entropy: bool = True,
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) and the full-vocabulary entropy of sharded logits.

    logits: [T, V/tp] (any float dtype); targets: [T] global vocabulary ids.
    Returns (logprobs [T], entropy [T]) in fp32 (fp64 for fp64 logits), differentiable w.r.t.
    ``logits``. With ``with_entropy=False`` the entropy is zeros and costs nothing.
    ``chunk_tokens=None`` picks chunks of about 2**24 elements. ``inplace_backward=True`` writes
    the gradient into the logits tensor itself (as megatron's vocab-parallel cross entropy does):
    only when nothing else reads those logits after this op.
    """
    return _LogprobEntropy.apply(logits, targets, tp_group, chunk_tokens, with_entropy, inplace_backward)


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, tp_group: Any = None, chunk_tokens: int | None = None
) -> torch.Tensor:
    """log p(targets) of sharded logits: [T, V/tp], [T] -> [T]."""
    return vocab_parallel_logprobs_entropy(logits, targets, tp_group, chunk_tokens, with_entropy=False)[0]


def vocab_parallel_entropy(
    logits: torch.Tensor, tp_group: Any = None, chunk_tokens: int | None = None
) -> torch.Tensor:
    """Full-vocabulary entropy of sharded logits: [T, V/tp] -> [T]."""
    targets = torch.full(
        (logits.shape[0],), _vocab_range(logits, tp_group)[0], dtype=torch.long, device=logits.device
    )
    return vocab_parallel_logprobs_entropy(logits, targets, tp_group, chunk_tokens, with_entropy=True)[1]


def _softmax_stats(logits: torch.Tensor, group: Any, chunk: int) -> torch.Tensor:
    """Global log-sum-exp per token (no autograd): [T, V/tp] -> [T] in the accumulation dtype."""
    T = logits.shape[0]
    acc = _acc_dtype(logits)
    lmax = torch.empty(T, dtype=acc, device=logits.device)
    partial = torch.zeros(1, T, dtype=acc, device=logits.device)
    for s, e in _chunks(T, chunk, logits.shape[-1]):
        z = logits[s:e].to(acc)
        m = z.max(-1).values
        lmax[s:e] = m
        partial[0, s:e] = torch.exp(z - m.unsqueeze(-1)).sum(-1)
    gmax, sums, _ = _global_lse(lmax, partial, group)
    return gmax + torch.log(sums[0])


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, group, chunk):
        lse = _softmax_stats(logits, group, chunk)
        ctx.save_for_backward(logits, lse)
        ctx.chunk = chunk
        return lse

    @staticmethod
    def backward(ctx, g):
        logits, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s, e in _chunks(logits.shape[0], ctx.chunk, logits.shape[-1]):
            p = torch.exp(logits[s:e].to(lse.dtype) - lse[s:e].unsqueeze(-1))
            grad[s:e] = (p * g[s:e].to(lse.dtype).unsqueeze(-1)).to(grad.dtype)
        return grad, None, None


def vocab_parallel_logsumexp(
    logits: torch.Tensor, tp_group: Any = None, chunk_tokens: int | None = None
) -> torch.Tensor:
    """log Σ_v exp(logits_v) over the full vocabulary: [T, V/tp] -> [T]; gradient softmax."""
    return _LogSumExp.apply(logits, tp_group, chunk_tokens)


def _paired_log_probs(a: torch.Tensor, b: torch.Tensor, lse_a: torch.Tensor, lse_b: torch.Tensor, chunk):
    """Yield (start, end, log p_a, log p_b) per token chunk of two equally sharded logits."""
    acc = lse_a.dtype
    for s, e in _chunks(a.shape[0], chunk, a.shape[-1]):
        yield s, e, a[s:e].to(acc) - lse_a[s:e].unsqueeze(-1), b[s:e].to(acc) - lse_b[s:e].unsqueeze(-1)


class _KL(torch.autograd.Function):
    """KL(p_a || p_b) of two sharded distributions; gradients to both logits."""

    @staticmethod
    def forward(ctx, a, b, group, chunk):
        lse_a, lse_b = _softmax_stats(a, group, chunk), _softmax_stats(b, group, chunk)
        acc = lse_a.dtype
        kl = torch.zeros(a.shape[0], dtype=acc, device=a.device)
        for s, e, la, lb in _paired_log_probs(a, b, lse_a, lse_b, chunk):
            kl[s:e] = (torch.exp(la) * (la - lb)).sum(-1)
        comm.all_reduce(kl, "sum", group)
        ctx.save_for_backward(a, b, lse_a, lse_b, kl)
        ctx.chunk = chunk
        return kl

    @staticmethod
    def backward(ctx, g):
        a, b, lse_a, lse_b, kl = ctx.saved_tensors
        acc = lse_a.dtype
        ga = torch.empty_like(a) if ctx.needs_input_grad[0] else None
        gb = torch.empty_like(b) if ctx.needs_input_grad[1] else None
        for s, e, la, lb in _paired_log_probs(a, b, lse_a, lse_b, ctx.chunk):
            pa = torch.exp(la)
            gs = g[s:e].to(acc).unsqueeze(-1)
            if ga is not None:  # dKL/dz_a = p_a (log p_a - log p_b - KL)
                ga[s:e] = (gs * pa * (la - lb - kl[s:e].unsqueeze(-1))).to(ga.dtype)
            if gb is not None:  # dKL/dz_b = p_b - p_a
                gb[s:e] = (gs * (torch.exp(lb) - pa)).to(gb.dtype)
        return ga, gb, None, None


def vocab_parallel_kl(
    logits_p: torch.Tensor, logits_q: torch.Tensor, tp_group: Any = None, chunk_tokens: int | None = None
) -> torch.Tensor:
    """KL(softmax(logits_p) || softmax(logits_q)) per token over the full vocabulary.

    logits_p, logits_q: [T, V/tp] sharded the same way -> [T]. Differentiable w.r.t. both.
    Forward distillation KL(teacher || student) is ``vocab_parallel_kl(teacher, student)``.
    """
    return _KL.apply(logits_p, logits_q, tp_group, chunk_tokens)


class _Bhattacharyya(torch.autograd.Function):
    """BC = Σ_v sqrt(p_v q_v) of two sharded distributions."""

    @staticmethod
    def forward(ctx, a, b, group, chunk):
        lse_a, lse_b = _softmax_stats(a, group, chunk), _softmax_stats(b, group, chunk)
        acc = lse_a.dtype
        bc = torch.zeros(a.shape[0], dtype=acc, device=a.device)
        for s, e, la, lb in _paired_log_probs(a, b, lse_a, lse_b, chunk):
            bc[s:e] = torch.exp(0.5 * (la + lb)).sum(-1)
        comm.all_reduce(bc, "sum", group)
        ctx.save_for_backward(a, b, lse_a, lse_b, bc)
        ctx.chunk = chunk
        return bc

    @staticmethod
    def backward(ctx, g):
        a, b, lse_a, lse_b, bc = ctx.saved_tensors
        acc = lse_a.dtype
        grads = [
            torch.empty_like(a) if ctx.needs_input_grad[0] else None,
            torch.empty_like(b) if ctx.needs_input_grad[1] else None,
        ]
        for s, e, la, lb in _paired_log_probs(a, b, lse_a, lse_b, ctx.chunk):
            root = torch.exp(0.5 * (la + lb))
            gs = g[s:e].to(acc).unsqueeze(-1)
            bcs = bc[s:e].unsqueeze(-1)
            # dBC/dz_j = (sqrt(p_j q_j) - p_j BC) / 2, symmetric in the two arguments
            for gout, lx in zip(grads, (la, lb)):
                if gout is not None:
                    gout[s:e] = (gs * 0.5 * (root - torch.exp(lx) * bcs)).to(gout.dtype)
        return grads[0], grads[1], None, None


def vocab_parallel_bhattacharyya(
    logits_p: torch.Tensor, logits_q: torch.Tensor, tp_group: Any = None, chunk_tokens: int | None = None
) -> torch.Tensor:
    """Bhattacharyya coefficient Σ_v sqrt(p_v q_v) per token: [T, V/tp] x2 -> [T]."""
    return _Bhattacharyya.apply(logits_p, logits_q, tp_group, chunk_tokens)


def vocab_parallel_hellinger_sq(
    logits_p: torch.Tensor, logits_q: torch.Tensor, tp_group: Any = None, chunk_tokens: int | None = None
) -> torch.Tensor:
    """Squared Hellinger distance 1 - BC per token: [T, V/tp] x2 -> [T]."""
    return 1 - vocab_parallel_bhattacharyya(logits_p, logits_q, tp_group, chunk_tokens)


@torch.no_grad()
def vocab_parallel_topk(
    logits: torch.Tensor, k: int, tp_group: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits over the full vocabulary and their global ids (no gradient).

    logits: [T, V/tp] -> (values [T, k], ids [T, k]), sorted descending; ties go to the lower id,
    as torch.topk does on the full logits.
    """
    v0, _ = _vocab_range(logits, tp_group)
    kk = min(k, logits.shape[-1])
    vals, ids = torch.topk(logits, kk, dim=-1, sorted=True)
    ids = ids + v0
    all_vals = torch.cat(comm.all_gather(vals.contiguous(), tp_group), -1)  # [T, tp·kk], ranks in id order
    all_ids = torch.cat(comm.all_gather(ids.contiguous(), tp_group), -1)
    # stable sort on -value keeps rank (= id) order among equal values
    order = torch.sort(-all_vals, dim=-1, stable=True).indices[:, :k]
    return all_vals.gather(-1, order), all_ids.gather(-1, order)


class _GatherLogits(torch.autograd.Function):
    """z[t, ids[t, k]] of sharded logits: each rank gathers the ids in its vocab range, one
    all-reduce sums them; the gradient lands on the owning rank's column."""

    @staticmethod
    def forward(ctx, logits, ids, group):
        v0, v1 = _vocab_range(logits, group)
        own = (ids >= v0) & (ids < v1)
        local = (ids - v0).clamp(0, logits.shape[-1] - 1)
        out = torch.where(own, logits.gather(-1, local), torch.zeros((), dtype=logits.dtype))
        comm.all_reduce(out, "sum", group)
        ctx.save_for_backward(own, local)
        ctx.shape = logits.shape
        return out

    @staticmethod
    def backward(ctx, g):
        own, local = ctx.saved_tensors
        grad = torch.zeros(ctx.shape, dtype=g.dtype, device=g.device)
        grad.scatter_add_(-1, local, torch.where(own, g, torch.zeros((), dtype=g.dtype)))
        return grad, None, None


def vocab_parallel_gather_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, tp_group: Any = None, chunk_tokens: int | None = None
) -> torch.Tensor:
    """log softmax(logits)[t, ids[t, k]] at arbitrary global ids (e.g. a teacher's top-K):
    logits [T, V/tp], ids [T, K] int64 in [0, V) -> [T, K]; differentiable w.r.t. the logits."""
    lse = vocab_parallel_logsumexp(logits, tp_group, chunk_tokens)
    acc = _acc_dtype(logits)
    return _GatherLogits.apply(logits, ids.long(), tp_group).to(acc) - lse.to(acc).unsqueeze(-1)


def vocab_parallel_jsd(
    logits_p: torch.Tensor, logits_q: torch.Tensor, tp_group: Any = None, chunk_tokens: int | None = None
) -> torch.Tensor:
    """Jensen-Shannon divergence per token, ½ KL(p || m) + ½ KL(q || m) with m = ½ (p + q):
    [T, V/tp] x2 -> [T]; differentiable w.r.t. both (plain autograd over this rank's shard, one
    all-reduce of the per-token partial sums; unlike the KL it keeps a few fp32 [T, V/tp]
    temporaries for backward)."""
    acc = _acc_dtype(logits_p)
    lse_p = _SumGradOverRanks.apply(vocab_parallel_logsumexp(logits_p, tp_group, chunk_tokens), tp_group)
    lse_q = _SumGradOverRanks.apply(vocab_parallel_logsumexp(logits_q, tp_group, chunk_tokens), tp_group)
    lp = logits_p.to(acc) - lse_p.to(acc).unsqueeze(-1)
    lq = logits_q.to(acc) - lse_q.to(acc).unsqueeze(-1)
    lm = torch.logaddexp(lp, lq) - math.log(2.0)
    part = 0.5 * (torch.exp(lp) * (lp - lm) + torch.exp(lq) * (lq - lm)).sum(-1)
    return _SumOverRanks.apply(part, tp_group)


class _SumOverRanks(torch.autograd.Function):
    """Σ over the TP ranks of per-rank partial values; every rank's loss uses the sum, so the
    gradient of each rank's own partial is the incoming gradient."""

    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x.clone(), "sum", group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _SumGradOverRanks(torch.autograd.Function):
    """Identity on a value replicated over the TP ranks (a log-normaliser) that each rank then uses
    in its own partial sum: its gradient is the sum of every rank's."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return comm.all_reduce(g.clone(), "sum", ctx.group), None
