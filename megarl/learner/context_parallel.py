"""Context parallelism (CP) for packed rows: which tokens a CP rank holds, and the collectives that
put them back together.

Layout (the load-balanced one of Transformer Engine's THD path): every sequence is padded to a
multiple of ``2 * cp`` tokens and cut into ``2 * cp`` equal chunks; CP rank ``r`` holds chunks ``r``
and ``2 * cp - 1 - r`` of every sequence, so under a causal mask each rank does the same attention
work. Each rank runs the layers on its own tokens only (activations are 1/cp of the row); attention
needs every earlier key of the sequence:
- CUDA with Transformer Engine: TE's attention exchanges keys and values itself (megatron's
  ``TEDotProductAttention`` with ``cp_group``); megarl only partitions the row (``packed_inputs``).
- CPU (varlen attention): ``gather_from_cp`` collects the keys and values of the whole row on every
  rank, and each rank attends with its own queries (``cp_varlen_attention``); simple, exact, and
  O(T) memory per rank for keys/values, which is what a CPU run can afford.
The last stage's logits are gathered back to the packed order (``gather_from_cp``), so the objective,
its normalisers and every metric see the same ``[T, V/tp]`` tensor as without CP. Gradients: each
rank's backward keeps its own slice, and megatron's DDP sums gradients over data x context parallel
ranks (megarl reduces with SUM, see learner.py), which adds the ranks' parts into the full gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass
class CPPartition:
    """One CP rank's share of a packed row.

    ``cu_padded: [B+1]`` sequence boundaries after padding each sequence to a multiple of ``2*cp``;
    ``index: [T_local]`` positions (in the padded row) of this rank's tokens, in local order;
    ``all_index: [cp, T_local]`` the same for every rank (rank-major order of an all-gather);
    ``real: [T_pad]`` True where the padded row holds a real token (False = per-sequence padding).
    """

    cp: int
    rank: int
    cu_seqlens: torch.Tensor  # [B+1] the real boundaries
    cu_padded: torch.Tensor  # [B+1]
    all_index: torch.Tensor  # [cp, T_local]
    real: torch.Tensor  # [T_pad] bool

    @property
    def index(self) -> torch.Tensor:
        """``[T_local]`` this rank's positions in the padded row."""
        return self.all_index[self.rank]

    @property
    def local_cu_seqlens(self) -> torch.Tensor:
        """``[B+1]`` boundaries of this rank's tokens (each sequence keeps 2 chunks: L_pad / cp)."""
        return self.cu_padded // self.cp


def cp_partition(cu_seqlens: torch.Tensor, cp: int, rank: int, multiple: int = 1) -> CPPartition:
    """The load-balanced CP layout of a packed row with boundaries ``cu_seqlens: [B+1]``.

    Each sequence is padded to a multiple of ``2 * cp * multiple`` (``multiple``: e.g. the TP size
    under sequence parallelism, so each rank's row divides evenly over TP)."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"context parallel rank {rank} of size {cp}")
    cu = cu_seqlens.to(torch.long).cpu()
    lens = cu[1:] - cu[:-1]
    step = 2 * cp * multiple
    padded = (lens + step - 1) // step * step
    cu_pad = torch.zeros_like(cu)
    cu_pad[1:] = torch.cumsum(padded, 0)
    real = torch.zeros(int(cu_pad[-1]), dtype=torch.bool)
    for start, n in zip(cu_pad[:-1].tolist(), lens.tolist()):
        real[start : start + n] = True
    rows = []
    for r in range(cp):
        parts = []
        for start, length in zip(cu_pad[:-1].tolist(), padded.tolist()):
            chunk = length // (2 * cp)
            for c in (r, 2 * cp - 1 - r):
                parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
        rows.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long))
    return CPPartition(cp, rank, cu, cu_pad, torch.stack(rows), real)


_PARTITIONS: dict[tuple, CPPartition] = {}


def cached_partition(cu_padded: torch.Tensor, cp: int, rank: int) -> CPPartition:
    """``cp_partition`` of boundaries that are already CP-padded (what the attention layers receive),
    computed once per micro-batch rather than once per layer."""
    key = (tuple(cu_padded.tolist()), cp, rank)
    part = _PARTITIONS.get(key)
    if part is None:
        if len(_PARTITIONS) > 64:
            _PARTITIONS.clear()
        part = _PARTITIONS[key] = cp_partition(cu_padded, cp, rank)
    return part


def padded_tokens(tokens: torch.Tensor, part: CPPartition) -> torch.Tensor:
    """``tokens: [T]`` -> ``[T_pad]`` in the padded row (padding is token 0)."""
    out = tokens.new_zeros(int(part.cu_padded[-1]))
    out[part.real.to(tokens.device)] = tokens
    return out


def padded_positions(part: CPPartition) -> torch.Tensor:
    """``[T_pad]`` position of every token of the padded row inside its sequence."""
    cu = part.cu_padded
    lens = cu[1:] - cu[:-1]
    return torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1], lens)


class _GatherFromCP(torch.autograd.Function):
    """All-gather of every rank's ``[T_local, ...]`` into the padded row ``[T_pad, ...]``; backward:
    this rank's slice of the gradient (``reduce_grad``: summed over ranks first, for tensors whose
    gathered copy every rank uses differently, e.g. keys and values)."""

    @staticmethod
    def forward(ctx, x, all_index, group, reduce_grad):
        ctx.group, ctx.reduce_grad = group, reduce_grad
        ctx.save_for_backward(all_index)
        cp = all_index.shape[0]
        pieces = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        flat = all_index.reshape(-1).to(x.device)
        out = x.new_empty((flat.numel(), *x.shape[1:]))
        return out.index_copy_(0, flat, torch.cat(pieces))

    @staticmethod
    def backward(ctx, grad):
        (all_index,) = ctx.saved_tensors
        grad = grad.contiguous()
        if ctx.reduce_grad:
            dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad.index_select(0, all_index[rank].to(grad.device)), None, None, None


def gather_from_cp(
    x: torch.Tensor, part: CPPartition, group: dist.ProcessGroup, reduce_grad: bool = False
) -> torch.Tensor:
    """``x: [T_local, ...]`` of every CP rank -> ``[T_pad, ...]`` in the padded row's order."""
    return _GatherFromCP.apply(x, part.all_index, group, reduce_grad)


def drop_padding(x: torch.Tensor, part: CPPartition) -> torch.Tensor:
    """``[T_pad, ...]`` -> ``[T, ...]`` (the real tokens, packed as in the batch)."""
    return x[part.real.to(x.device)]


def cp_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    part: CPPartition,
    group: dist.ProcessGroup,
    scale: float,
) -> torch.Tensor:
    """Causal per-sequence attention of this rank's queries over the whole row's keys (CPU path).

    ``query: [T_local, 1, np, hn]``, ``key``/``value``: ``[T_local, 1, ng, hn]`` (this rank's tokens
    in ``part``'s local order). Keys and values are gathered from every CP rank; each sequence's
    local queries attend to the keys at positions up to their own. Returns ``[T_local, 1, np*hn]``.
    """
    T_local, b, nq, hn = query.shape
    if b != 1:
        raise ValueError(f"context-parallel attention takes one packed row (batch 1), got batch {b}")
    k = gather_from_cp(key[:, 0], part, group, reduce_grad=True)  # [T_pad, ng, hn]
    v = gather_from_cp(value[:, 0], part, group, reduce_grad=True)
    if k.shape[1] != nq:
        k = k.repeat_interleave(nq // k.shape[1], dim=1)
        v = v.repeat_interleave(nq // v.shape[1], dim=1)
    q = query[:, 0]
    pos = padded_positions(part).to(q.device)
    local_cu = part.local_cu_seqlens.tolist()
    out = q.new_empty(T_local, nq * hn)
    for s, (a, b_) in enumerate(zip(part.cu_padded[:-1].tolist(), part.cu_padded[1:].tolist())):
        lo, hi = local_cu[s], local_cu[s + 1]
        if hi == lo:
            continue
        qpos = pos[part.index[lo:hi].to(q.device)]  # [Lq]
        allowed = pos[a:b_][None, :] <= qpos[:, None]  # [Lq, L]
        o = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1)[None],  # [1, np, Lq, hn]
            k[a:b_].transpose(0, 1)[None],
            v[a:b_].transpose(0, 1)[None],
            attn_mask=allowed[None, None],
            scale=scale,
        )
        out[lo:hi] = o[0].transpose(0, 1).reshape(hi - lo, nq * hn)
    return out.unsqueeze(1)
