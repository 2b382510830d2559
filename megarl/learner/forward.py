"""Packed-sequence forward of a megatron-core GPTModel, and the shift to the batch's alignment.

CPU path (local spec): the T packed tokens run as one ``[1, T]`` row with per-sequence RoPE
positions; attention is per sequence (``megarl/learner/varlen_attention.py``: the boundaries travel
as a 1-D ``cu_seqlens`` in the attention-mask argument, O(sum L_i^2)), which gives the same numbers
as running each sequence on its own (tests/learner: packed vs one-at-a-time). ``attention="dense"``
builds the block-diagonal causal ``[T, T]`` mask instead (O(T^2); the path of a megatron-core the
varlen attention does not support, of the local spec on CUDA, and the tests' reference).
GPU path (TE spec): megatron's THD packed-sequence path (``PackedSeqParams`` from cu_seqlens).
Context parallelism: each CP rank runs its load-balanced share of every sequence and the last
stage's logits are gathered back to the packed order (``megarl/learner/context_parallel.py``).

Alignment: the model's logits at position t predict token t+1. megarl's convention
(megarl/batch.py) wants ``logits[t]`` to score ``tokens[t]``, so ``align_logits`` shifts by one
within each sequence; the first token of each sequence gets zero logits (it is never in the loss).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.learner.context_parallel import (
    CPPartition,
    cp_partition,
    drop_padding,
    gather_from_cp,
    padded_positions,
    padded_tokens,
)
from megarl.learner.model import cpu_varlen, uses_te_spec


@dataclass
class PackedInputs:
    """Model inputs of one micro-batch, padded to ``T_pad`` (a multiple of ``pad_multiple``)."""

    input_ids: torch.Tensor  # [1, T_pad]
    position_ids: torch.Tensor  # [1, T_pad] position inside each sequence
    # CPU path: cu_seqlens [B'+1] int64 (varlen) or [1, 1, T_pad, T_pad] bool, True = masked (dense)
    attention_mask: torch.Tensor | None
    packed_seq_params: object | None  # megatron PackedSeqParams (GPU/TE path)
    padding_mask: torch.Tensor | None  # [1, T_pad] bool, True = padding (excluded from MoE routing)
    num_tokens: int  # T (real tokens)
    cp_partition: CPPartition | None = None  # context parallelism: this rank's share of the row
    cp_group: object | None = None


def packed_inputs(
    tokens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    device: torch.device,
    pad_multiple: int = 1,
    attention: str = "auto",
    cp_group=None,
) -> PackedInputs:
    """Build model inputs for packed ``tokens: [T]`` with boundaries ``cu_seqlens: [B+1]``.

    Padding (for sequence parallelism, T_pad % tp == 0) is its own trailing sequence of token 0,
    excluded from MoE routing statistics by ``padding_mask``; its logits are dropped.
    ``attention`` (local spec): 'auto' (varlen where ``cpu_varlen()``, else dense), 'varlen' or
    'dense'; the TE spec always uses THD packing.
    """
    if attention not in ("auto", "varlen", "dense"):
        raise ValueError(f"attention={attention!r}; allowed: auto, varlen, dense")
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        return _cp_inputs(tokens, cu_seqlens, device, pad_multiple, attention, cp_group)
    T = int(tokens.numel())
    T_pad = -(-T // pad_multiple) * pad_multiple
    cu = cu_seqlens.to(torch.long).cpu()
    if T_pad > T:
        cu = torch.cat([cu, torch.tensor([T_pad])])
        tokens = torch.cat([tokens, tokens.new_zeros(T_pad - T)])
    lens = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lens)
    pos = torch.arange(T_pad) - starts
    padding = torch.zeros(1, T_pad, dtype=torch.bool)
    padding[0, T:] = True
    if uses_te_spec():
        from megatron.core.packed_seq_params import PackedSeqParams

        cu32 = cu.to(torch.int32).to(device)
        maxlen = int(lens.max())
        psp = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu32, cu_seqlens_kv=cu32, max_seqlen_q=maxlen, max_seqlen_kv=maxlen
        )
        mask = None
    elif attention == "varlen" or (attention == "auto" and cpu_varlen()):
        mask = cu.to(device)
        psp = None
    else:
        seq = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        allowed = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
        mask = (~allowed)[None, None].to(device)
        psp = None
    return PackedInputs(
        input_ids=tokens.view(1, -1).to(device),
        position_ids=pos.view(1, -1).to(device),
        attention_mask=mask,
        packed_seq_params=psp,
        padding_mask=padding.to(device),
        num_tokens=T,
    )


def _cp_inputs(tokens, cu_seqlens, device, pad_multiple: int, attention: str, cp_group) -> PackedInputs:
    """``packed_inputs`` of this context-parallel rank: its two chunks of every (padded) sequence
    (``megarl/learner/context_parallel.py``)."""
    cp, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    part = cp_partition(cu_seqlens, cp, rank, multiple=pad_multiple)
    idx = part.index
    local_tokens = padded_tokens(tokens.cpu(), part)[idx]
    pos = padded_positions(part)[idx]
    padding = ~part.real[idx]
    if uses_te_spec():
        from megatron.core.packed_seq_params import PackedSeqParams

        cu32 = part.cu_seqlens.to(torch.int32).to(device)
        pad32 = part.cu_padded.to(torch.int32).to(device)
        maxlen = int((part.cu_padded[1:] - part.cu_padded[:-1]).max())
        psp = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu32,
            cu_seqlens_kv=cu32,
            cu_seqlens_q_padded=pad32,
            cu_seqlens_kv_padded=pad32,
            max_seqlen_q=maxlen,
            max_seqlen_kv=maxlen,
        )
        mask = None
    elif attention != "dense" and cpu_varlen():
        mask, psp = part.cu_padded.to(device), None
    else:
        raise ValueError(
            "context parallelism needs the varlen attention on CPU or Transformer Engine on CUDA; "
            f"attention={attention!r}, varlen available: {cpu_varlen()}"
        )
    return PackedInputs(
        input_ids=local_tokens.view(1, -1).to(device),
        position_ids=pos.view(1, -1).to(device),
        attention_mask=mask,
        packed_seq_params=psp,
        padding_mask=padding.view(1, -1).to(device),
        num_tokens=int(cu_seqlens[-1]),
        cp_partition=part,
        cp_group=cp_group,
    )


class _PackedRope:
    """Replaces a RotaryEmbedding's forward: RoPE angles at per-sequence positions (CPU path)."""

    def __init__(self, rope: torch.nn.Module):
        self.rope = rope
        self.original_forward = rope.forward
        self.positions: torch.Tensor | None = None
        self.cp = 1  # megatron asks for cp x the local length under context parallelism

    def __call__(self, max_seq_len: int, *args, **kwargs) -> torch.Tensor:
        if self.positions is None:
            return self.original_forward(max_seq_len, *args, **kwargs)
        if int(self.positions.numel()) * self.cp != int(max_seq_len):
            raise RuntimeError(
                f"packed RoPE: {self.positions.numel()} positions for a sequence of {max_seq_len}"
            )
        emb = self.rope.get_emb(int(self.positions.max()) + 1)  # [P, 1, 1, dim]
        return emb[self.positions]  # [T, 1, 1, dim]


def _packed_rope(model: torch.nn.Module) -> _PackedRope | None:
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:
        return None
    hook = getattr(model, "_megarl_packed_rope", None)
    if hook is None:
        hook = _PackedRope(rope)
        rope.forward = hook
        model._megarl_packed_rope = hook
    return hook


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _device_mode_off(inner: torch.nn.Module) -> contextlib.AbstractContextManager:
    """The CPU shims' device mode off for the forward of a model without MoE layers (nothing in it
    names a CUDA device; cpu_shims ``device_mode_off``); a no-op without the shims (GPU runs never
    import them) or for MoE models."""
    shims = sys.modules.get("megarl.learner.cpu_shims")
    spec = getattr(inner, "megarl_spec", None)
    if shims is None or spec is None or spec.is_moe:
        return contextlib.nullcontext()
    return shims.device_mode_off()


def run_model(model: torch.nn.Module, inputs: PackedInputs) -> torch.Tensor:
    """One stage's forward on packed inputs. Last stage: logits ``[T_pad, V/tp]`` (next-token,
    unaligned); other stages: hidden states for the next stage."""
    inner = unwrap(model)
    hook = _packed_rope(inner) if inputs.packed_seq_params is None else None
    part = inputs.cp_partition
    if hook is not None:
        hook.positions = inputs.position_ids[0]
        hook.cp = part.cp if part is not None else 1
    try:
        with _device_mode_off(inner):
            out = model(
                inputs.input_ids,
                inputs.position_ids,
                inputs.attention_mask,
                packed_seq_params=inputs.packed_seq_params,
                padding_mask=inputs.padding_mask,
            )
    finally:
        if hook is not None:
            hook.positions = None
    if inner.post_process:
        if part is not None:  # this rank's [T_local, V/tp] -> the whole row's [T, V/tp]
            return drop_padding(gather_from_cp(out[0], part, inputs.cp_group), part)
        return out[0]  # [1, T_pad, V/tp] -> [T_pad, V/tp]
    return out


def align_logits(logits: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Next-token logits ``[T(_pad), V/tp]`` -> aligned ``[T, V/tp]``: out[t] scores tokens[t].

    out[t] = logits[t-1] inside a sequence; out[first token of a sequence] = 0 (never in the loss).
    """
    T = int(cu_seqlens[-1])
    shifted = torch.roll(logits[:T], shifts=1, dims=0)
    keep = torch.ones(T, 1, dtype=logits.dtype, device=logits.device)
    keep[cu_seqlens[:-1].to(logits.device)] = 0
    return shifted * keep
