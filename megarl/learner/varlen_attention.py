"""Per-sequence (varlen) attention for packed rows on the CPU path.

A packed row holds B sequences back to back. Attention over it with a dense block-diagonal causal
``[T, T]`` mask costs O(T^2) time and memory although only the diagonal blocks are used; here each
sequence attends to itself only, O(sum L_i^2). Sequences of similar length are padded to the
longest of them, stacked and go through one causal ``scaled_dot_product_attention`` call
(``segment_plan``: the padding is bounded by a fraction of the real scores), so a batch of GRPO
samples costs one call per layer, not one per sequence or per distinct length.

Wiring (CPU only, see ``varlen_enabled``): the local layer spec's core attention becomes
``VarlenDotProductAttention`` (``megarl/learner/model.py``) and ``packed_inputs`` passes the
sequence boundaries ``cu_seqlens`` (a 1-D int64 tensor) in the ``attention_mask`` argument, which
megatron hands unchanged to the core attention (a tensor argument, so activation recomputation
would carry it too). A 4-D boolean mask still takes megatron's dense path. Under context
parallelism the 1-D tensor holds the CP-padded boundaries and each rank attends with its own
queries over the gathered keys (``megarl/learner/context_parallel.py``). CUDA runs never use
this module: the TE spec uses THD packing, and the local spec on CUDA keeps the dense mask.
"""

from __future__ import annotations

import inspect
import itertools
import re
from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist
import torch.nn.functional as F

# The DotProductAttention.forward parameters this subclass is written against (megatron-core 0.16).
_FORWARD_PARAMS = (
    "query",
    "key",
    "value",
    "attention_mask",
    "attn_mask_type",
    "attention_bias",
    "packed_seq_params",
)


def _torch_at_least(major: int, minor: int) -> bool:
    """Whether the installed torch is ``major.minor`` or newer."""
    have = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    return have >= (major, minor)


def varlen_supported() -> bool:
    """Whether the installed megatron-core's ``DotProductAttention.forward`` has the signature this
    module overrides and torch's SDPA takes ``scale`` (torch >= 2.1); otherwise the dense mask path
    is used."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    params = tuple(inspect.signature(DotProductAttention.forward).parameters)[1:]
    return params == _FORWARD_PARAMS and _torch_at_least(2, 1)


@dataclass(frozen=True)
class Bucket:
    """Sequences attended together: ``n`` rows padded to ``length`` tokens. ``index: [n * length]``
    the packed positions of the rows (a row's padding repeats its last token, which its real
    queries never attend under the causal mask); None when the rows are the packed row itself
    (every sequence, all of this length, in order), so no gather is needed."""

    n: int
    length: int
    index: torch.Tensor | None


@dataclass(frozen=True)
class SegmentPlan:
    """How ``varlen_attention`` runs a packed row: its buckets, and ``back: [T]`` (the row of each
    packed token in the buckets' padded outputs, concatenated), None when no gather is needed."""

    buckets: tuple[Bucket, ...]
    back: torch.Tensor | None


# A bucket grows while its padded causal score count n * L_max^2 stays within PAD_SLACK x the real
# sum of L_i^2 plus PAD_FREE (a separate bucket costs a few more ops than that many scores).
PAD_SLACK = 1.25
PAD_FREE = 4096


def segment_plan(cu_seqlens: torch.Tensor) -> SegmentPlan:
    """Group the packed sequences into padded buckets, longest first. Sequences of similar length
    (GRPO samples of one prompt length) share one bucket: one attention call per layer and a few
    gathers, not one call per distinct length; very different lengths get their own buckets, so
    padding never costs more than ``PAD_SLACK`` x the per-sequence scores (plus ``PAD_FREE``)."""
    cu = cu_seqlens.to(torch.long).cpu().tolist()
    lens = [b - a for a, b in itertools.pairwise(cu)]
    order = sorted((i for i in range(len(lens)) if lens[i] > 0), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    i = 0
    while i < len(order):
        top = lens[order[i]]
        j, sumsq = i, 0
        while j < len(order):
            sq = lens[order[j]] ** 2
            if (j - i + 1) * top * top > PAD_SLACK * (sumsq + sq) + PAD_FREE:
                break
            sumsq += sq
            j += 1
        groups.append(order[i:j])
        i = j
    T = cu[-1]
    if len(groups) == 1 and len(set(lens)) == 1:  # the row is already [n, L]: views only
        return SegmentPlan((Bucket(len(lens), lens[0], None),), None)
    buckets, back, row = [], [0] * T, 0
    for seqs in groups:
        top = lens[seqs[0]]
        index = []
        for s in seqs:
            start, n = cu[s], lens[s]
            index += [start + min(t, n - 1) for t in range(top)]
            back[start : start + n] = range(row, row + n)
            row += top
        buckets.append(Bucket(len(seqs), top, torch.tensor(index)))
    return SegmentPlan(tuple(buckets), torch.tensor(back))


_LAST_PLAN: list = []  # [cu_seqlens, plan] of the last row: every layer of a forward reuses it


def _cached_plan(cu_seqlens: torch.Tensor) -> SegmentPlan:
    cu = cu_seqlens.to(torch.long).cpu()
    if _LAST_PLAN and _LAST_PLAN[0].shape == cu.shape and bool(torch.equal(_LAST_PLAN[0], cu)):
        return _LAST_PLAN[1]
    plan = segment_plan(cu)
    _LAST_PLAN[:] = [cu.clone(), plan]
    return plan


@cache
def _sdpa_gqa() -> bool:
    """Whether torch's SDPA takes ``enable_gqa`` (torch >= 2.5): grouped-query heads without copies."""
    return _torch_at_least(2, 5)


def varlen_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of each packed sequence with itself.

    ``query: [T, 1, np, hn]``, ``key``/``value``: ``[T, 1, ng, hn]`` (grouped-query heads: SDPA's
    ``enable_gqa``, or repeated to ``np`` before torch 2.5), ``cu_seqlens: [B+1]`` with
    ``cu_seqlens[-1] == T``. Returns ``[T, 1, np*hn]``, the layout of megatron's core attention
    output. Each bucket of ``segment_plan`` is one causal ``scaled_dot_product_attention`` call.
    """
    T, b, nq, hn = query.shape
    if b != 1:
        raise ValueError(f"varlen attention takes one packed row (batch 1), got batch {b}")
    if int(cu_seqlens[-1]) != T:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])}, the packed row has {T} tokens")
    q, k, v = query[:, 0], key[:, 0], value[:, 0]  # [T, heads, hn]
    nk = k.shape[1]
    gqa = nk != nq and _sdpa_gqa()
    if nk != nq and not gqa:
        k = k.repeat_interleave(nq // nk, dim=1)
        v = v.repeat_interleave(nq // nk, dim=1)
    plan = _cached_plan(cu_seqlens)
    pieces = []
    for bk in plan.buckets:
        if bk.index is None:
            qs, ks, vs = q, k, v
        else:
            flat = bk.index.to(q.device)
            qs, ks, vs = (x.index_select(0, flat) for x in (q, k, v))
        # [n*L, heads, hn] -> [n, heads, L, hn]
        qs, ks, vs = (x.view(bk.n, bk.length, x.shape[1], hn).transpose(1, 2) for x in (qs, ks, vs))
        kw = {"enable_gqa": True} if gqa else {}
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, **kw)
        pieces.append(o.transpose(1, 2).reshape(bk.n * bk.length, nq * hn))
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    if plan.back is not None:
        out = out.index_select(0, plan.back.to(out.device))
    return out.unsqueeze(1)


def varlen_core_attention_class() -> type:
    """``VarlenDotProductAttention``: megatron's ``DotProductAttention`` that runs
    ``varlen_attention`` when its ``attention_mask`` argument is a 1-D ``cu_seqlens`` tensor."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class VarlenDotProductAttention(DotProductAttention):
        """Core attention of the CPU local spec: per-sequence attention for packed rows."""

        def __init__(self, config, *args, **kwargs):
            cp = config.context_parallel_size
            # megatron's core attention refuses CP (only its TE attention exchanges keys and
            # values); this class does the exchange itself (megarl.learner.context_parallel)
            config.context_parallel_size = 1
            try:
                super().__init__(config, *args, **kwargs)
            finally:
                config.context_parallel_size = cp
            self.cp_size = cp
            if config.softmax_type != "vanilla" or self.scale_mask_softmax.window_size is not None:
                raise ValueError(
                    f"varlen attention supports softmax_type='vanilla' without a window, got "
                    f"softmax_type={config.softmax_type!r}, window_size={config.window_size}"
                )
            # megatron divides softmax_scale by the layer-scaling coefficient and multiplies the
            # scores back in its softmax; the product is the scale of the scores
            self.varlen_scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
        ):
            if attention_mask is None or attention_mask.dim() != 1:
                return super().forward(
                    query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
                )
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("varlen attention takes neither packed_seq_params nor attention_bias")
            if self.training and self.attention_dropout.p > 0:
                raise ValueError("varlen attention has no attention dropout (megarl trains with 0)")
            if self.cp_size > 1:
                from megatron.core import parallel_state as ps

                from megarl.learner.context_parallel import cached_partition, cp_varlen_attention

                group = ps.get_context_parallel_group()
                part = cached_partition(attention_mask, self.cp_size, dist.get_rank(group))
                return cp_varlen_attention(query, key, value, part, group, self.varlen_scale)
            return varlen_attention(query, key, value, attention_mask, self.varlen_scale)

    return VarlenDotProductAttention
