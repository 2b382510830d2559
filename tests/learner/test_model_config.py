"""HF config features of the model provider: activations, dense layers in MoE models, attention
biases, FFN sizes vs tensor parallelism.

Without processes: what ``model_spec_from_hf`` / ``check_model_layout`` accept and refuse.
With 2 gloo ranks (dist_cases.py, one launch): logprobs equal transformers' and HF -> Megatron -> HF
export is bit-exact for each supported variant; refused variants fail when the learner is built,
with a message naming the config key.
"""

from __future__ import annotations

import pytest
from test_learner_dist import _check, _launch

from megarl.learner.model import HFConfigError, check_model_layout, model_spec_from_hf

DENSE = dict(
    model_type="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
MOE = dict(DENSE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


@pytest.mark.parametrize("act", ["silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu"])
def test_supported_activations(act):
    assert model_spec_from_hf(dict(DENSE, hidden_act=act)).hidden_act == act


def test_activation_defaults_to_silu():
    assert model_spec_from_hf(DENSE).hidden_act == "silu"


@pytest.mark.parametrize("act", ["relu2", "tanh", "laplace"])
def test_unknown_activation_is_refused_by_name(act):
    with pytest.raises(HFConfigError, match=f"hidden_act '{act}'"):
        model_spec_from_hf(dict(DENSE, hidden_act=act))


@pytest.mark.parametrize("mt", ["qwen3", "llama"])
def test_attention_bias_is_refused_naming_the_key_and_o_proj(mt):
    with pytest.raises(HFConfigError, match="attention_bias") as e:
        model_spec_from_hf(dict(DENSE, model_type=mt, attention_bias=True))
    assert "o_proj" in str(e.value)


def test_llama_mlp_bias_is_refused():
    with pytest.raises(HFConfigError, match="mlp_bias"):
        model_spec_from_hf(dict(DENSE, model_type="llama", mlp_bias=True))


def test_qwen2_keeps_its_qkv_bias():
    assert model_spec_from_hf(dict(DENSE, model_type="qwen2")).qkv_bias


@pytest.mark.parametrize(
    ("cfg", "kw", "key"),
    [
        (dict(DENSE, intermediate_size=49), dict(tp=2), "intermediate_size"),
        (dict(MOE, moe_intermediate_size=17), dict(tp=2, ep=2, expert_tp=2), "moe_intermediate_size"),
        (dict(MOE, moe_intermediate_size=17), dict(tp=2, ep=2), "moe_intermediate_size"),  # expert tp = tp
        (dict(DENSE, vocab_size=65), dict(tp=2), "vocab_size"),
        (dict(DENSE, num_attention_heads=6, num_key_value_heads=6), dict(tp=4), "num_attention_heads"),
        (dict(DENSE, num_key_value_heads=1), dict(tp=2), "num_key_value_heads"),
        (DENSE, dict(pp=3), "num_hidden_layers"),
        (MOE, dict(ep=3), "num_experts"),
    ],
)
def test_check_model_layout_names_the_key(cfg, kw, key):
    with pytest.raises(ValueError, match=key):
        check_model_layout(cfg, **kw)


def test_check_model_layout_accepts_what_divides():
    check_model_layout(DENSE, tp=2, pp=2)
    # all layers MoE: the dense intermediate_size (49) is never built, so it need not divide tp
    check_model_layout(dict(MOE, intermediate_size=49), tp=2, ep=2, expert_tp=1)
    check_model_layout(dict(MOE, moe_intermediate_size=18), tp=2, ep=2)


CASES = [
    "vparity:gelutanh:tp1",
    "vparity:gelutanh:tp2",
    "vparity:gelu:pp2",
    "vparity:moedense:tp1",
    "vparity:moedense:ep2",
    "vparity:moesparse2:pp2",
    "vparity:moesparse2:tp2sp",
    "refused:ffn129:tp2:intermediate_size",
    "refused:moeffn33:tp2sp:moe_intermediate_size",
    "refused:attnbias:tp1:attention_bias",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _launch(2, CASES, str(tmp_path_factory.mktemp("modelcfg")), timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_variant_on_two_ranks(results, case):
    _check(results, case)
