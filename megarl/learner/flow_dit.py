"""A tiny velocity model on megatron-core: a DiT-style transformer over continuous patch tokens.

A point ``x`` of ``dim`` coordinates is cut into ``dim / patch`` tokens of ``patch`` values (the
2-D toy: two tokens of one coordinate; an 8x8 image flattened: patches of its pixels). Each token is
``W_in · patch + pos_i + temb(t)``, with ``temb(t) = W_2 SiLU(W_1 [sin, cos](2π f t))`` (the time
added to every token); a megatron-core ``TransformerBlock`` (local spec: RMSNorm, self-attention
with NO mask, i.e. bidirectional, a plain or Mixture-of-Experts MLP, final RMSNorm) mixes them;
``W_out`` maps every token back to its ``patch`` velocity values. The block is sharded like the
language model: its attention and MLP linears are megatron's Column/RowParallel layers under the
run's TP group, experts split over the EP group (alltoall dispatch); the embeddings and the head
are small and replicated (under TP every rank computes the same values and gradients for them).

``full_weights`` gathers every shard into full tensors named like the model's own parameters: the
plain-PyTorch twin in reference/flow.py (``dit_velocity``) reads exactly those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class FlowDiTSpec:
    """The DiT's shape: ``dim`` point coordinates in tokens of ``patch``; ``hidden`` width,
    ``layers``, ``heads``; ``ffn`` the MLP width (the experts' too); ``experts`` (0: a plain MLP)
    with ``topk`` routing; ``freqs`` time frequencies; ``norm_eps`` of the RMSNorms."""

    dim: int = 2
    patch: int = 1
    hidden: int = 32
    layers: int = 2
    heads: int = 4
    ffn: int = 64
    experts: int = 0
    topk: int = 2
    freqs: int = 4
    norm_eps: float = 1e-6

    @property
    def tokens(self) -> int:
        """Tokens per point."""
        return self.dim // self.patch

    def check(self, tp: int = 1, ep: int = 1, where: str = "flow model") -> None:
        """Refuse shapes the layout cannot shard, naming the field."""
        if self.dim % self.patch:
            raise ValueError(f"{where}: dim={self.dim} is not divisible by patch={self.patch}")
        if self.hidden % self.heads:
            raise ValueError(f"{where}: hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.heads % tp or self.ffn % tp:
            raise ValueError(f"{where}: heads={self.heads} and ffn={self.ffn} must be divisible by tp={tp}")
        if self.experts and (self.experts % ep or not 1 <= self.topk <= self.experts):
            raise ValueError(
                f"{where}: experts={self.experts} must be divisible by ep={ep}, and 1 <= topk <= experts"
            )
        if self.experts and tp > 1:
            raise ValueError(f"{where}: a Mixture-of-Experts flow model needs tp=1 (got tp={tp})")


def transformer_config(spec: FlowDiTSpec, groups: Any, params_dtype: torch.dtype = torch.float32):
    """The megatron-core ``TransformerConfig`` of the DiT's block under ``groups.layout``."""
    from megatron.core.transformer import TransformerConfig

    lay = groups.layout
    if lay.pp > 1 or lay.cp > 1:
        raise ValueError(f"flow model: no pipeline or context parallelism (pp={lay.pp}, cp={lay.cp})")
    spec.check(lay.tp, lay.ep)
    kw: dict[str, Any] = dict(
        num_layers=spec.layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        ffn_hidden_size=spec.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=False,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=lay.tp,
        expert_model_parallel_size=lay.ep,
        expert_tensor_parallel_size=lay.etp,
        sequence_parallel=False,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=groups.device.type == "cpu",
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        attention_softmax_in_fp32=False,
        init_method_std=0.1,
        moe_token_dispatcher_type="alltoall",
    )
    if spec.experts:
        kw.update(
            num_moe_experts=spec.experts,
            moe_router_topk=spec.topk,
            moe_ffn_hidden_size=spec.ffn,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
        )
    return TransformerConfig(**kw)


def block_spec(spec: FlowDiTSpec):
    """megatron's local layer spec with bidirectional attention (no mask)."""
    from dataclasses import replace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    layer = get_gpt_layer_local_spec(
        num_experts=spec.experts or None, moe_grouped_gemm=False, normalization="RMSNorm"
    )
    attn = replace(layer.submodules.self_attention, params={"attn_mask_type": AttnMaskType.no_mask})
    return replace(layer, submodules=replace(layer.submodules, self_attention=attn))


def time_features(t: torch.Tensor, freqs: int) -> torch.Tensor:
    """[B, 2 freqs]: sin and cos of 2π f t, f = 1..freqs."""
    f = torch.arange(1, freqs + 1, dtype=t.dtype, device=t.device)
    ang = 2 * math.pi * t[:, None] * f[None]
    return torch.cat([torch.sin(ang), torch.cos(ang)], -1)


class FlowDiT(nn.Module):
    """v_θ(x, t) over points ``x`` [B, dim] at times ``t`` (a float or [B]); see the module docstring."""

    def __init__(self, spec: FlowDiTSpec, groups: Any, params_dtype: torch.dtype = torch.float32):
        super().__init__()
        from megatron.core.transformer.transformer_block import TransformerBlock

        self.spec, self.config = spec, transformer_config(spec, groups, params_dtype)
        kw = {"dtype": params_dtype}
        self.patch_in = nn.Linear(spec.patch, spec.hidden, **kw)
        self.pos = nn.Parameter(0.1 * torch.randn(spec.tokens, spec.hidden, **kw))
        self.time_in = nn.Linear(2 * spec.freqs, spec.hidden, **kw)
        self.time_out = nn.Linear(spec.hidden, spec.hidden, **kw)
        self.block = TransformerBlock(self.config, block_spec(spec), pg_collection=groups.pg_collection)
        self.head = nn.Linear(spec.hidden, spec.patch, **kw)
        self.to(device=groups.device, dtype=params_dtype)  # the norms are built in float32

    def forward(self, x: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
        """[B, dim] velocities, on ``x``'s device (computed on the model's)."""
        s, home = self.spec, x.device
        dtype, device = self.head.weight.dtype, self.head.weight.device
        x = x.to(device=device, dtype=dtype)
        t = torch.as_tensor(t, dtype=dtype).to(device).expand(x.shape[0])
        temb = self.time_out(torch.nn.functional.silu(self.time_in(time_features(t, s.freqs))))
        h = self.patch_in(x.reshape(-1, s.tokens, s.patch)) + self.pos[None] + temb[:, None]
        h = self.block(h.transpose(0, 1).contiguous(), attention_mask=None)  # [tokens, B, hidden]
        return self.head(h).transpose(0, 1).reshape(x.shape[0], s.dim).to(home)


def _gather(t: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """``t`` from every rank of ``group``, concatenated along ``dim``."""
    if group is None or dist.get_world_size(group) == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim)


def _expert_name(name: str, ep_rank: int, per_rank: int) -> str:
    """``...experts.local_experts.i...`` -> the global expert index ``ep_rank·per_rank + i``."""
    head, _, rest = name.partition("local_experts.")
    i, _, tail = rest.partition(".")
    return f"{head}local_experts.{ep_rank * per_rank + int(i)}.{tail}"


def full_weights(model: FlowDiT, groups: Any, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or, ``grads``: its reduced gradient, megatron DDP's ``main_grad`` where
    present) as the full tensor, named like the model's parameters with global expert indices.
    Collective over the TP and EP groups; the same dict on every rank."""
    out: dict[str, torch.Tensor] = {}
    ep, per = groups.layout.ep, model.spec.experts // max(groups.layout.ep, 1)
    for name, p in model.named_parameters():
        t = p.detach()
        if grads:
            t = getattr(p, "main_grad", None)
            t = p.grad if t is None else t
            t = torch.zeros_like(p) if t is None else t.detach()
        expert = "local_experts." in name
        if getattr(p, "tensor_model_parallel", False) and groups.layout.tp > 1 and not expert:
            t = _gather(t, groups.tp, p.partition_dim)
        if expert and ep > 1:
            parts = [torch.empty_like(t) for _ in range(ep)]
            dist.all_gather(parts, t.contiguous(), group=groups.ep)
            for r, part in enumerate(parts):
                out[_expert_name(name, r, per)] = part
            continue
        out[name] = t.clone()
    return out
