"""Dump pieces without a model: batch round trip through a dump's files, data-parallel shares
joined back into the global batch, model compatibility checks."""

import dataclasses

import pytest
import torch

from megarl.batch import from_sequences
from megarl.faults.dump import (
    DumpError,
    batch_from_dict,
    batch_to_dict,
    check_compatible,
    concat_batches,
    model_shape,
)
from megarl.objectives.api import GlobalNormalisers


def batch():
    b = from_sequences([[2, 3], [2, 4, 5], [2, 6], [2, 7]], [[8, 9, 1], [10, 1], [11, 12, 13, 1], [14, 1]],
                       [0, 0, 1, 1], rewards=torch.tensor([1.0, 0.0, 0.5, 0.2]),
                       rollout_logprobs=torch.linspace(-1, 0, 20))
    b.advantages = torch.randn(b.num_tokens)
    b.extras = {"w": torch.arange(4.0)}
    return b


def same(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
        elif isinstance(x, dict):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f.name
        else:
            assert x == y, f.name


def test_batch_dict_round_trip_and_dp_shares_concatenate_back():
    b = batch()
    same(batch_from_dict(batch_to_dict(b)), b)
    shares = [b.select([0, 1]), b.select([2, 3])]
    same(concat_batches(shares), b)
    assert concat_batches([b]) is b
    half = b.select([0])
    half.advantages = None
    with pytest.raises(DumpError, match="'advantages' is set in some data-parallel shares only"):
        concat_batches([half, b.select([1])])
    with pytest.raises(DumpError, match="not a PackedBatch field"):
        batch_from_dict({**batch_to_dict(b), "bogus": 1})
    assert GlobalNormalisers(**dataclasses.asdict(GlobalNormalisers(3.0, 2.0))) == GlobalNormalisers(3.0, 2.0)


def test_compatibility_allows_fewer_experts_only():
    base = {"model_type": "qwen3_moe", "vocab_size": 24, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
            "num_experts_per_tok": 2}
    dumped = model_shape(base)
    assert check_compatible(dumped, base, "m") == []
    notes = check_compatible(dumped, {**base, "num_experts": 4}, "p")
    assert notes == ["proxy: 4 routed experts (top-2) instead of 8 (top-2)"]
    with pytest.raises(DumpError, match="recorded routes"):
        check_compatible(dumped, {**base, "num_experts": 4}, "p", uses_routes=True)
    with pytest.raises(DumpError, match=r"model d does not fit the dump: .*num_experts: dump 8, model 0 \(dense vs MoE\)"):
        check_compatible(dumped, {**base, "model_type": "qwen3", "num_experts": 0}, "d")
    with pytest.raises(DumpError, match="num_attention_heads: dump 4, model 8; head_dim: dump 16, model 8"):
        check_compatible(dumped, {**base, "head_dim": 8, "num_attention_heads": 8}, "h")
