"""Conversion plan and sharding math, without processes: names, key checks, shard/unshard inverses."""

from __future__ import annotations

import pytest
import torch

from megarl.convert.hf_megatron import ConversionError, check_hf_keys, shard_hf, unshard_to_hf
from megarl.convert.plan import build_plan, expected_hf_names
from megarl.learner.model import HFConfigError, model_spec_from_hf

DENSE = dict(
    model_type="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    tie_word_embeddings=False,
)
MOE = dict(
    DENSE,
    model_type="qwen3_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
)


def test_plan_covers_hf_names_once():
    spec = model_spec_from_hf(MOE)
    plan = build_plan(spec, pp=2, ep=2)
    names = expected_hf_names(plan)
    assert len(names) == len(set(names))
    assert "model.layers.1.mlp.gate_proj.weight" in names  # mlp_only_layers stays dense
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in names
    # stage 1 holds layers 2, 3 under local names 0, 1; expert 3 on EP rank 1 as local expert 1
    e = next(x for x in plan if x.hf_names == ("model.layers.2.mlp.experts.3.down_proj.weight",))
    assert (e.stage, e.ep_owner, e.mcore_name) == (
        1,
        1,
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_shard_unshard_inverse(tp):
    spec = model_spec_from_hf(DENSE)
    g = torch.Generator().manual_seed(0)
    plan = build_plan(spec)
    shapes = {"q": (32, 32), "k": (16, 32), "v": (16, 32), "gate": (48, 32), "up": (48, 32), "o": (32, 32)}
    for e in plan:
        if e.kind == "qkv":
            hf = [torch.randn(*shapes[p], generator=g) for p in "qkv"]
        elif e.kind == "glu":
            hf = [torch.randn(48, 32, generator=g), torch.randn(48, 32, generator=g)]
        elif e.kind == "row":
            hf = [torch.randn(32, 48 if "fc2" in e.mcore_name else 32, generator=g)]
        elif e.kind == "vocab":
            hf = [torch.randn(64, 32, generator=g)]
        else:
            hf = [torch.randn(32, generator=g)]
        shards = [shard_hf(e, hf, spec, tp, r) for r in range(tp)]
        back = unshard_to_hf(e, shards, spec)
        assert all(torch.equal(a, b) for a, b in zip(hf, back)), e.mcore_name


def test_qkv_layout_is_megatron_interleaved():
    spec = model_spec_from_hf(DENSE)  # 4 heads, 2 KV groups, head_dim 8
    e = next(x for x in build_plan(spec) if x.kind == "qkv")
    q = torch.arange(32.0).repeat_interleave(1).view(32, 1).expand(32, 32)
    k = 100 + torch.arange(16.0).view(16, 1).expand(16, 32)
    v = 200 + torch.arange(16.0).view(16, 1).expand(16, 32)
    full = shard_hf(e, [q, k, v], spec, 1, 0)[:, 0]
    # group 0: q heads 0,1 (rows 0..15), k head 0, v head 0; then group 1
    assert full[:16].tolist() == list(range(16))
    assert full[16:24].tolist() == [100.0 + i for i in range(8)]
    assert full[24:32].tolist() == [200.0 + i for i in range(8)]
    assert full[32:48].tolist() == list(range(16, 32))


def test_key_check_names_every_bad_key():
    plan = build_plan(model_spec_from_hf(DENSE))
    names = expected_hf_names(plan)
    bad = [n for n in names if n != "model.norm.weight"] + ["model.layers.9.input_layernorm.weight", "junk.w"]
    with pytest.raises(ConversionError) as ei:
        check_hf_keys(bad, plan, "ckpt")
    msg = str(ei.value)
    assert "missing 1: ['model.norm.weight']" in msg
    assert "unknown 1: ['junk.w']" in msg
    assert "unused 1: ['model.layers.9.input_layernorm.weight']" in msg
    check_hf_keys(names, plan, "ckpt")  # the exact set passes


def test_tied_model_reads_no_lm_head():
    spec = model_spec_from_hf(dict(DENSE, tie_word_embeddings=True))
    assert "lm_head.weight" not in expected_hf_names(build_plan(spec))
    with pytest.raises(ConversionError, match="unused 1: \\['lm_head.weight'\\]"):
        plan = build_plan(spec)
        check_hf_keys(expected_hf_names(plan) + ["lm_head.weight"], plan, "ckpt")


def test_config_errors_name_the_key():
    with pytest.raises(HFConfigError, match="'hidden_size'"):
        model_spec_from_hf({k: v for k, v in DENSE.items() if k != "hidden_size"})
    with pytest.raises(HFConfigError, match="model_type 'gpt2'"):
        model_spec_from_hf(dict(DENSE, model_type="gpt2"))
