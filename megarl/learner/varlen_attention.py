"""Per-sequence (varlen) attention for packed rows on the CPU path.

A packed row holds B sequences back to back. Attention over it with a dense block-diagonal causal
``[T, T]`` mask costs O(T^2) time and memory although only the diagonal blocks are used; here each
sequence attends to itself only, O(sum L_i^2). Sequences of equal length are stacked and go
through one causal ``scaled_dot_product_attention`` call, so a batch of GRPO samples (a few distinct
lengths) costs a few calls per layer, not one per sequence.

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
import re

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


def varlen_supported() -> bool:
    """Whether the installed megatron-core's ``DotProductAttention.forward`` has the signature this
    module overrides and torch's SDPA takes ``scale`` (torch >= 2.1); otherwise the dense mask path
    is used."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    params = tuple(inspect.signature(DotProductAttention.forward).parameters)[1:]
    major, minor = (int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    return params == _FORWARD_PARAMS and (major, minor) >= (2, 1)


def segment_plan(cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Token indices of the packed row grouped by sequence length: one ``[n, L]`` tensor per
    distinct length L (row i = the positions of the i-th sequence of that length)."""
    cu = cu_seqlens.to(torch.long).cpu()
    lens = cu[1:] - cu[:-1]
    starts = cu[:-1]
    plan = []
    for length in torch.unique(lens).tolist():
        if length == 0:
            continue
        s = starts[lens == length]
        plan.append(s[:, None] + torch.arange(length)[None, :])
    return plan


def varlen_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of each packed sequence with itself.

    ``query: [T, 1, np, hn]``, ``key``/``value``: ``[T, 1, ng, hn]`` (grouped-query heads are
    repeated to ``np``), ``cu_seqlens: [B+1]`` with ``cu_seqlens[-1] == T``. Returns ``[T, 1, np*hn]``,
    the layout of megatron's core attention output.
    """
    T, b, nq, hn = query.shape
    if b != 1:
        raise ValueError(f"varlen attention takes one packed row (batch 1), got batch {b}")
    if int(cu_seqlens[-1]) != T:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])}, the packed row has {T} tokens")
    q, k, v = query[:, 0], key[:, 0], value[:, 0]  # [T, heads, hn]
    if k.shape[1] != nq:
        k = k.repeat_interleave(nq // k.shape[1], dim=1)
        v = v.repeat_interleave(nq // v.shape[1], dim=1)
    pieces, order = [], []
    for idx in segment_plan(cu_seqlens):
        n, length = idx.shape
        flat = idx.reshape(-1).to(q.device)
        # [n*L, heads, hn] -> [n, heads, L, hn]
        qs, ks, vs = (x.index_select(0, flat).view(n, length, nq, hn).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        pieces.append(o.transpose(1, 2).reshape(n * length, nq * hn))
        order.append(flat)
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    perm = order[0] if len(order) == 1 else torch.cat(order)
    if not bool(torch.equal(perm, torch.arange(T, device=perm.device))):
        out = out.new_empty(T, nq * hn).index_copy(0, perm, out)
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
