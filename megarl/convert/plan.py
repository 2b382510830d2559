"""The name and sharding plan between HF tensors and megatron-core parameters.

One ``Entry`` per megatron-core parameter of the *whole* model (all pipeline stages, all experts):
which HF tensors it is made of, how they are cut for tensor parallelism, and which pipeline stage
and expert-parallel rank own it. Loading and export both walk this plan; nothing else knows names.

Sharding kinds (``tp`` ranks; ``r`` = TP rank):
- ``replicated``: norms, q/k norms, router; every rank holds the full tensor.
- ``vocab`` / ``column``: rows split in ``tp`` contiguous blocks (embedding, lm_head).
- ``row``: columns split (o_proj, down_proj).
- ``glu``: ``[gate; up]``, each of gate and up split by rows, rank r holds ``[gate_r; up_r]``.
- ``qkv``: q, k, v regrouped per KV group ``[q_g (heads/groups · d), k_g (d), v_g (d)]``,
  groups split contiguously over TP ranks (megatron's interleaved QKV layout).
Expert weights (``expert`` set) use ``glu`` / ``row`` over the *expert* tensor-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.learner.model import ModelSpec


@dataclass(frozen=True)
class Entry:
    """One megatron-core parameter and the HF tensors it comes from."""

    mcore_name: str  # local name on its pipeline stage, e.g. decoder.layers.0.mlp.linear_fc1.weight
    hf_names: tuple[str, ...]  # one HF tensor, or (gate, up) for glu, (q, k, v) for qkv
    kind: str  # replicated | vocab | column | row | glu | qkv
    stage: int  # pipeline stage that owns it
    expert: int | None = None  # global expert index for expert weights
    ep_owner: int = 0  # expert-parallel rank that holds this expert
    tied_copy: bool = False  # output layer of a tied model on a later stage: loaded, never exported


def layers_of_stage(num_layers: int, pp: int, stage: int) -> range:
    """Global layer indices on ``stage`` (megatron's uniform split)."""
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


def build_plan(spec: ModelSpec, pp: int = 1, ep: int = 1, te_names: bool = False) -> list[Entry]:
    """Every megatron-core parameter of ``spec`` with its HF source, in a fixed global order.

    ``te_names``: use the Transformer Engine spec's names (fused input/pre-MLP norms, grouped
    experts) instead of the local spec's.
    """
    out: list[Entry] = []
    last = pp - 1
    out.append(Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0))
    for s in range(pp):
        for li, g in enumerate(layers_of_stage(spec.num_layers, pp, s)):
            m = f"decoder.layers.{li}."
            h = f"model.layers.{g}."
            moe = g in spec.moe_layers
            attn_norm = m + (
                "self_attention.linear_qkv.layer_norm_weight" if te_names else "input_layernorm.weight"
            )
            out.append(Entry(attn_norm, (h + "input_layernorm.weight",), "replicated", s))
            out.append(
                Entry(
                    m + "self_attention.linear_qkv.weight",
                    tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"),
                    "qkv",
                    s,
                )
            )
            if spec.qkv_bias:
                out.append(
                    Entry(
                        m + "self_attention.linear_qkv.bias",
                        tuple(h + f"self_attn.{p}_proj.bias" for p in "qkv"),
                        "qkv",
                        s,
                    )
                )
            if spec.qk_layernorm:
                out.append(
                    Entry(
                        m + "self_attention.q_layernorm.weight",
                        (h + "self_attn.q_norm.weight",),
                        "replicated",
                        s,
                    )
                )
                out.append(
                    Entry(
                        m + "self_attention.k_layernorm.weight",
                        (h + "self_attn.k_norm.weight",),
                        "replicated",
                        s,
                    )
                )
            out.append(
                Entry(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "row", s)
            )
            mlp_norm = m + (
                "mlp.linear_fc1.layer_norm_weight" if te_names and not moe else "pre_mlp_layernorm.weight"
            )
            out.append(Entry(mlp_norm, (h + "post_attention_layernorm.weight",), "replicated", s))
            if not moe:
                out.append(
                    Entry(
                        m + "mlp.linear_fc1.weight",
                        (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                        "glu",
                        s,
                    )
                )
                out.append(Entry(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row", s))
                continue
            out.append(Entry(m + "mlp.router.weight", (h + "mlp.gate.weight",), "replicated", s))
            per = spec.num_experts // ep
            for e in range(spec.num_experts):
                owner, k = divmod(e, per)
                hx = h + f"mlp.experts.{e}."
                if te_names:
                    fc1, fc2 = (
                        m + f"mlp.experts.linear_fc1.weight{k}",
                        m + f"mlp.experts.linear_fc2.weight{k}",
                    )
                else:
                    fc1 = m + f"mlp.experts.local_experts.{k}.linear_fc1.weight"
                    fc2 = m + f"mlp.experts.local_experts.{k}.linear_fc2.weight"
                # Expert weights are cut over the expert-TP group (not the TP group) and live on one EP rank.
                out.append(
                    Entry(
                        fc1,
                        (hx + "gate_proj.weight", hx + "up_proj.weight"),
                        "glu",
                        s,
                        expert=e,
                        ep_owner=owner,
                    )
                )
                out.append(Entry(fc2, (hx + "down_proj.weight",), "row", s, expert=e, ep_owner=owner))
    out.append(Entry("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated", last))
    if not spec.tie_word_embeddings:
        out.append(Entry("output_layer.weight", ("lm_head.weight",), "vocab", last))
    elif pp > 1:
        out.append(
            Entry("output_layer.weight", ("model.embed_tokens.weight",), "vocab", last, tied_copy=True)
        )
    return out


def expected_hf_names(plan: list[Entry]) -> list[str]:
    """All HF tensor names the plan reads, in plan order, without duplicates."""
    seen: dict[str, None] = {}
    for e in plan:
        for n in e.hf_names:
            seen.setdefault(n, None)
    return list(seen)
