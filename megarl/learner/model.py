"""Model provider: a megatron-core ``GPTModel`` from a Hugging Face config (Qwen3, Qwen3-MoE, Llama).

On CPU: local layer spec (torch RMSNorm, megatron's DotProductAttention), ``SequentialMLP`` experts,
fp32, every fusion off. With Transformer Engine and CUDA: the TE layer spec and grouped GEMM experts.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F

from megarl.learner.parallel import ParallelGroups, use_cuda

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama", "qwen2")


class HFConfigError(ValueError):
    """The Hugging Face config is missing a key or uses a feature the provider does not support."""


@dataclass(frozen=True)
class ModelSpec:
    """What the provider and the converter need to know about the architecture (global shapes)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float
    rope_theta: float
    qk_layernorm: bool
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_experts: int = 0  # 0 = dense
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = True
    moe_aux_loss_coeff: float = 0.0
    moe_layers: tuple[int, ...] = ()  # global indices of MoE layers
    hidden_act: str = "silu"  # HF name of the activation on the gate of the gated MLP

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


# HF ``hidden_act`` -> the function megatron applies to the gate half of its gated MLP (fc1 = [gate; up],
# out = act(gate) * up, as HF's ``act_fn(gate_proj(x)) * up_proj(x)``). gelu_new is the tanh
# approximation written out (equal up to float rounding).
_GELU_TANH = partial(F.gelu, approximate="tanh")
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _GELU_TANH,
    "gelu_new": _GELU_TANH,
    "relu": F.relu,
}


def _activation_name(hf: dict, where: str) -> str:
    """The config's ``hidden_act`` (default silu); refuses an activation not in ``ACTIVATIONS``."""
    act = hf.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise HFConfigError(
            f"{where}: hidden_act '{act}' is not supported (supported: {sorted(ACTIVATIONS)})"
        )
    return act


def _check_biases(hf: dict, mt: str, where: str) -> None:
    """Refuse the bias options megatron-core cannot express per layer.

    Qwen3 / Llama ``attention_bias`` puts a bias on q, k, v *and* o_proj; megatron-core gives the
    attention output projection a bias only through ``add_bias_linear``, which also adds biases to
    every MLP and expert linear layer. (Qwen2's fixed q/k/v bias, without o_proj, is supported.)
    """
    if mt != "qwen2" and hf.get("attention_bias"):
        raise HFConfigError(
            f"{where}: attention_bias=true is not supported: it adds a bias to o_proj "
            "(model.layers.N.self_attn.o_proj.bias) as well as to q/k/v, and megatron-core has an attention "
            "output bias only together with biases on every MLP linear layer (add_bias_linear)"
        )
    if hf.get("mlp_bias"):
        raise HFConfigError(f"{where}: mlp_bias=true is not supported (MLP biases)")


def load_hf_config(path_or_dict: str | os.PathLike | dict) -> dict:
    """A HF config as a dict, from a dict, a config.json path or a model directory."""
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    p = os.fspath(path_or_dict)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    with open(p) as f:
        return json.load(f)


def _need(cfg: dict, key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise HFConfigError(f"{where}: HF config has no '{key}'")
    return cfg[key]


def model_spec_from_hf(hf: dict) -> ModelSpec:
    """Read the architecture out of a HF config dict; raise ``HFConfigError`` naming bad keys."""
    mt = _need(hf, "model_type", "config")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise HFConfigError(
            f"config: model_type '{mt}' is not supported (supported: {SUPPORTED_MODEL_TYPES})"
        )
    where = f"config ({mt})"
    H = int(_need(hf, "hidden_size", where))
    nh = int(_need(hf, "num_attention_heads", where))
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") not in ("default", None):
        raise HFConfigError(f"{where}: rope_type '{rope.get('rope_type')}' is not supported (only 'default')")
    if hf.get("rope_scaling"):
        raise HFConfigError(f"{where}: 'rope_scaling' is not supported")
    if hf.get("use_sliding_window"):
        raise HFConfigError(f"{where}: 'use_sliding_window' is not supported")
    hidden_act = _activation_name(hf, where)
    _check_biases(hf, mt, where)
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0) if mt == "qwen3_moe" else 0
    L = int(_need(hf, "num_hidden_layers", where))
    moe_layers: tuple[int, ...] = ()
    if num_experts:
        step = int(hf.get("decoder_sparse_step", 1))
        only_mlp = set(hf.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(L) if i not in only_mlp and (i + 1) % step == 0)
    return ModelSpec(
        model_type=mt,
        vocab_size=int(_need(hf, "vocab_size", where)),
        hidden_size=H,
        num_layers=L,
        num_heads=nh,
        num_kv_heads=int(hf.get("num_key_value_heads") or nh),
        head_dim=int(hf.get("head_dim") or H // nh),
        ffn_hidden_size=int(_need(hf, "intermediate_size", where)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        qk_layernorm=mt.startswith("qwen3"),
        qkv_bias=mt == "qwen2",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        num_experts=num_experts,
        moe_topk=int(_need(hf, "num_experts_per_tok", where)) if num_experts else 0,
        moe_ffn_hidden_size=int(_need(hf, "moe_intermediate_size", where)) if num_experts else 0,
        moe_norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)) if num_experts else 0.0,
        moe_layers=moe_layers,
        hidden_act=hidden_act,
    )


def check_spec_layout(
    spec: ModelSpec, tp: int = 1, pp: int = 1, ep: int = 1, expert_tp: int | None = None
) -> None:
    """Raise ``HFConfigError`` (a ``ValueError``) naming the HF config key that a parallel layout
    does not divide: vocabulary, heads and dense FFN by ``tp``, layers by ``pp``, experts by ``ep``,
    the expert FFN by the expert tensor-parallel size (``expert_tp``, default ``tp``)."""
    etp = tp if expert_tp is None else expert_tp
    if spec.vocab_size % tp:
        raise HFConfigError(f"vocab_size {spec.vocab_size} is not divisible by tp={tp}")
    if spec.num_heads % tp:
        raise HFConfigError(f"num_attention_heads {spec.num_heads} is not divisible by tp={tp}")
    if spec.num_kv_heads % tp:
        raise HFConfigError(f"num_key_value_heads {spec.num_kv_heads} is not divisible by tp={tp}")
    if spec.num_layers % pp:
        raise HFConfigError(f"num_hidden_layers {spec.num_layers} is not divisible by pp={pp}")
    has_dense = len(spec.moe_layers) < spec.num_layers  # a dense MLP is built for some layer
    if has_dense and spec.ffn_hidden_size % tp:
        raise HFConfigError(f"intermediate_size {spec.ffn_hidden_size} is not divisible by tp={tp}")
    if spec.is_moe and spec.num_experts % ep:
        raise HFConfigError(f"num_experts {spec.num_experts} is not divisible by ep={ep}")
    if spec.is_moe and spec.moe_ffn_hidden_size % etp:
        raise HFConfigError(
            f"moe_intermediate_size {spec.moe_ffn_hidden_size} is not divisible by the expert "
            f"tensor-parallel size {etp}"
        )


def check_model_layout(
    hf_config: dict | str | os.PathLike, tp: int = 1, pp: int = 1, ep: int = 1, expert_tp: int | None = None
) -> ModelSpec:
    """Up-front check of a HF config (dict, config.json or model directory) against a parallel
    layout, before anything is built: raises ``HFConfigError`` (a ``ValueError``) naming the
    unsupported or non-divisible config key; returns the ``ModelSpec``."""
    spec = model_spec_from_hf(load_hf_config(hf_config))
    check_spec_layout(spec, tp, pp, ep, expert_tp)
    return spec


def transformer_config_from_spec(
    spec: ModelSpec,
    groups: ParallelGroups,
    *,
    params_dtype: torch.dtype = torch.float32,
    moe_aux_loss_coeff: float | None = None,
    perform_initialization: bool = True,
    init_method_std: float = 0.02,
    routing_replay: bool = False,
):
    """megatron-core ``TransformerConfig`` for ``spec`` under ``groups.layout``.

    fp32 on CPU; bf16 only when asked on CUDA. Dropout 0 (RL post-training default).
    """
    from megatron.core.transformer import TransformerConfig

    lay = groups.layout
    check_spec_layout(spec, lay.tp, lay.pp, lay.ep, lay.etp)
    if spec.is_moe and lay.tp > 1 and not lay.sequence_parallel:
        raise HFConfigError(
            f"MoE with tp={lay.tp} needs sequence_parallel=True (megatron-core refuses "
            "MoE + TP without SP in training)"
        )
    on_gpu = use_cuda()
    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=ACTIVATIONS[spec.hidden_act],
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=lay.tp,
        pipeline_model_parallel_size=lay.pp,
        expert_model_parallel_size=lay.ep,
        expert_tensor_parallel_size=lay.etp,
        context_parallel_size=lay.cp,
        sequence_parallel=lay.sequence_parallel,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        init_method_std=init_method_std,
        use_cpu_initialization=not on_gpu,
        perform_initialization=perform_initialization,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        attention_softmax_in_fp32=True,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
    )
    if spec.is_moe:
        kw["moe_layer_freq"] = [1 if i in spec.moe_layers else 0 for i in range(spec.num_layers)]
        kw.update(
            num_moe_experts=spec.num_experts,
            moe_router_topk=spec.moe_topk,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            # norm_topk_prob: softmax over the top-k logits == top-k of softmax, renormalised.
            moe_router_pre_softmax=not spec.moe_norm_topk_prob,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=spec.moe_aux_loss_coeff if moe_aux_loss_coeff is None else moe_aux_loss_coeff,
            moe_grouped_gemm=on_gpu,
            moe_permute_fusion=False,
            moe_router_dtype="fp32",
            moe_enable_routing_replay=routing_replay,
        )
    return TransformerConfig(**kw)


def layer_spec(config, spec: ModelSpec, groups: ParallelGroups):
    """The decoder spec of this rank's stage: local spec on CPU (or without TE), Transformer Engine
    spec on CUDA with TE installed.

    Dense models: one layer spec for every layer. MoE models: megatron's per-layer block spec, which
    reads ``config.moe_layer_freq`` (dense layers from ``mlp_only_layers`` / ``decoder_sparse_step``)
    and keeps this pipeline stage's layers.
    """
    from megatron.core.models.gpt import gpt_layer_specs as gls

    te = uses_te_spec()
    if spec.is_moe:
        kw: dict[str, Any] = {"normalization": "RMSNorm"}
        if "pp_rank" in inspect.signature(gls.get_gpt_decoder_block_spec).parameters:
            kw["pp_rank"] = groups.pp_rank  # else megatron reads it from parallel_state (same value)
        block = gls.get_gpt_decoder_block_spec(config, use_transformer_engine=te, **kw)
        if cpu_varlen():
            block.layer_specs = [_with_varlen_attention(s) for s in block.layer_specs]
        return block
    if te:
        return gls.get_gpt_layer_with_transformer_engine_spec(
            num_experts=None, moe_grouped_gemm=config.moe_grouped_gemm, qk_layernorm=spec.qk_layernorm
        )
    local = _with_gated_mlp(
        gls.get_gpt_layer_local_spec(
            num_experts=None, moe_grouped_gemm=False, qk_layernorm=spec.qk_layernorm, normalization="RMSNorm"
        ),
        groups.pg_collection.tp,
    )
    return _with_varlen_attention(local) if cpu_varlen() else local


@cache
def gated_mlp_class() -> type:
    """``GatedMLP``: megatron's ``MLP`` whose gated forward is ``act(gate) * up`` on the two halves of
    ``linear_fc1``'s output. megatron's own adds ``glu_linear_offset`` (0.0) to the up half first,
    which copies that strided half (and its gradient) on every layer; the numbers are the same (up
    to the sign of an exact zero). Other configurations take megatron's forward."""
    from megatron.core.transformer.mlp import MLP

    class GatedMLP(MLP):
        """The local spec's dense MLP (see ``gated_mlp_class``)."""

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            c = self.config
            if (
                per_token_scale is not None
                or not c.gated_linear_unit
                or c.use_te_activation_func
                or c.bias_activation_fusion
                or c.activation_func_clamp_value is not None
                or c.glu_linear_offset != 0.0
            ):
                return super().forward(hidden_states, per_token_scale, **kwargs)
            h, bias = self.linear_fc1(hidden_states)
            if bias is not None:
                h = h + bias
            gate, up = torch.chunk(h, 2, dim=-1)
            return self.linear_fc2(c.activation_func(gate) * up)

    return GatedMLP


def _with_gated_mlp(layer, tp_group):
    """A local layer spec whose dense MLP is ``GatedMLP`` (``gated_mlp_class``) on ``tp_group``:
    megatron's layer passes its TP group to its own ``MLP`` only, so the spec's params carry it
    (else the MLP would take parallel_state's global group)."""
    from dataclasses import replace

    from megatron.core.transformer.mlp import MLP

    mlp = layer.submodules.mlp
    if getattr(mlp, "module", None) is not MLP:
        return layer
    params = {**(mlp.params or {}), "tp_group": tp_group}
    gated = replace(mlp, module=gated_mlp_class(), params=params)
    return replace(layer, submodules=replace(layer.submodules, mlp=gated))


@contextlib.contextmanager
def _without_unknown_mlp_notice() -> Iterator[None]:
    """Drop megatron's "Unknown MLP type ... Using default kwargs" log line while a model is built:
    its layer says it for every MLP class but its own, once per layer; the only other class megarl's
    specs use is ``GatedMLP``, whose TP group comes through the spec (``_with_gated_mlp``)."""
    log = logging.getLogger("megatron.core.transformer.transformer_layer")

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type: ")

    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


def _with_varlen_attention(layer):
    """A local layer spec whose core attention is the per-sequence one (megarl.learner.varlen_attention)."""
    from dataclasses import replace

    from megarl.learner.varlen_attention import varlen_core_attention_class

    attn = layer.submodules.self_attention
    attn = replace(attn, submodules=replace(attn.submodules, core_attention=varlen_core_attention_class()))
    return replace(layer, submodules=replace(layer.submodules, self_attention=attn))


@cache
def cpu_varlen() -> bool:
    """Whether packed rows use per-sequence attention (``varlen_attention``): the CPU path (no
    CUDA) with a megatron-core whose core attention it was written against. Else a dense mask."""
    if use_cuda():
        return False
    from megarl.learner.varlen_attention import varlen_supported

    return varlen_supported()


def uses_te_spec() -> bool:
    """Whether ``layer_spec`` picks the Transformer Engine spec in this process."""
    if not use_cuda():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def build_gpt_model(
    hf_config: dict | str | os.PathLike,
    groups: ParallelGroups,
    *,
    params_dtype: torch.dtype = torch.float32,
    moe_aux_loss_coeff: float | None = None,
    perform_initialization: bool = True,
    routing_replay: bool = False,
):
    """Build this rank's pipeline stage of the model (a ``GPTModel``) under ``groups``.

    Logits come out vocab-parallel (``parallel_output=True``): ``[B, S, V/tp]``.
    Returns the model; its ``megarl_spec`` attribute holds the ``ModelSpec``.
    """
    from megatron.core.models.gpt import GPTModel

    spec = model_spec_from_hf(load_hf_config(hf_config))
    config = transformer_config_from_spec(
        spec,
        groups,
        params_dtype=params_dtype,
        moe_aux_loss_coeff=moe_aux_loss_coeff,
        perform_initialization=perform_initialization,
        routing_replay=routing_replay,
    )
    with _without_unknown_mlp_notice():
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(config, spec, groups),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=groups.is_first_stage,
            post_process=groups.is_last_stage,
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
            pg_collection=groups.pg_collection,
        )
    model.to(groups.device)
    model.megarl_spec = spec
    return model
