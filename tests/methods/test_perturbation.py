"""Seeded counter-based weight noise and exact perturb/restore (megarl/methods/gradients/).

Pure tensors here; the sharded learner under TP=2 and EP=2 on real gloo ranks is the
``perturb:*`` case of tests/learner/test_learner_dist.py (tests/learner/perturbation_cases.py)."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.perturbation as rp
from megarl.convert.hf_megatron import shard_hf
from megarl.convert.plan import Entry
from megarl.methods.gradients.noise import gaussian, tensor_key
from megarl.methods.gradients.perturbation import ParamNoise, WeightPerturbation, param_noise_map

SPEC = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=3)
H = 6  # hidden size of the toy tensors

# (entry, HF shapes) of every sharding kind the converter knows
ENTRIES = [
    (Entry("norm", ("model.norm.weight",), "replicated", 0), [(H,)]),
    (Entry("router", ("mlp.gate.weight",), "replicated", 0), [(4, H)]),
    (Entry("emb", ("model.embed_tokens.weight",), "vocab", 0), [(8, H)]),
    (Entry("col", ("lm_head.weight",), "column", 0), [(8, H)]),
    (Entry("row", ("o_proj.weight",), "row", 0), [(H, 8)]),
    (Entry("fc1", ("gate_proj.weight", "up_proj.weight"), "glu", 0), [(8, H), (8, H)]),
    (Entry("qkv", ("q.weight", "k.weight", "v.weight"), "qkv", 0), [(12, H), (6, H), (6, H)]),
    (Entry("qkv_b", ("q.bias", "k.bias", "v.bias"), "qkv", 0), [(12,), (6,), (6,)]),
]


@settings(max_examples=10)
@given(
    st.integers(0, 2**40),
    st.sampled_from(["a", "model.layers.3.mlp.experts.7.up_proj.weight"]),
    st.sampled_from([(5,), (3, 7), (1, 40)]),
)
def test_generator_equals_the_reference_bit_for_bit(seed, name, shape):
    k0, k1 = tensor_key(seed, name)
    n = torch.arange(int(torch.tensor(shape).prod())).view(shape)
    assert torch.equal(gaussian(k0, k1, n), rp.hf_noise(seed, name, shape))


def test_noise_is_standard_normal_and_seeds_are_independent():
    a, b = rp.hf_noise(1, "w", (400, 500)), rp.hf_noise(2, "w", (400, 500))
    assert abs(float(a.mean())) < 0.01 and abs(float(a.std()) - 1) < 0.01
    assert abs(float((a > 1.96).float().mean()) - 0.025) < 0.003
    assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 0.01
    assert not torch.equal(rp.hf_noise(1, "w", (4,)), rp.hf_noise(1, "v", (4,)))  # names key the noise
    with pytest.raises(ValueError, match="seed"):
        tensor_key(-1, "w")


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("entry,shapes", ENTRIES, ids=[e.mcore_name for e, _ in ENTRIES])
def test_every_shard_regenerates_its_slice_of_the_unsharded_noise(entry, shapes, tp):
    tp = min(tp, SPEC.num_kv_heads) if entry.kind == "qkv" else tp  # qkv shards whole KV groups
    full = [rp.hf_noise(9, n, s) for n, s in zip(entry.hf_names, shapes)]
    tpe = 1 if entry.kind == "replicated" else tp
    for r in range(tpe):
        want = shard_hf(entry, full, SPEC, tpe, r)
        p = torch.nn.Parameter(torch.zeros_like(want))
        got = param_noise_map(entry, p, SPEC, tpe, r).noise(9).view_as(p)
        assert torch.equal(got, want), (entry.kind, tp, r)


def _single(w: torch.Tensor, name: str = "w") -> WeightPerturbation:
    p = torch.nn.Parameter(w, requires_grad=False)
    e = Entry("w", (name,), "replicated", 0)
    return WeightPerturbation([param_noise_map(e, p, SPEC, 1, 0)])


WEIGHTS = st.sampled_from([torch.float32, torch.bfloat16]).flatmap(
    lambda dt: st.lists(
        st.floats(-3, 3, allow_nan=False, width=32) | st.sampled_from([-0.0, 1e-40, -1e-40, 1e6]),
        min_size=4,
        max_size=64,
    ).map(lambda v: torch.tensor(v, dtype=torch.float32).to(dt))
)


@settings(max_examples=15)
@given(WEIGHTS, st.sampled_from([0.0, 1e-4, 1e-2, 0.5, 30.0]), st.integers(0, 1000))
def test_perturb_writes_theta_plus_sigma_eps_and_restore_is_bit_exact(w, sigma, seed):
    before = w.clone()
    pert = _single(w.clone())
    pert.perturb(seed, sigma)
    want = rp.perturb_state({"w": before}, seed, sigma)["w"]
    assert torch.equal(pert.maps[0].param.data, want)
    pert.restore()
    bits = torch.int32 if w.dtype == torch.float32 else torch.int16
    assert torch.equal(pert.maps[0].param.data.view(bits), before.view(bits))
    assert pert.active is None


@pytest.mark.parametrize("sigma", [1e-4, 0.05])
def test_plain_resubtraction_is_not_exact_so_the_record_is_needed(sigma):
    w = torch.randn(4096) * 0.02
    pert = _single(w.clone())
    pert.perturb(3, sigma)
    pert.restore()
    assert pert.patched_elements > 20  # without the record these elements would be off by an ulp
    assert torch.equal(pert.maps[0].param.data, w)
    assert pert.recorded_bytes <= w.numel() * 4  # never more than a copy (σ = 0.05: half the elements)


def test_misuse_is_refused():
    pert = _single(torch.zeros(4))
    with pytest.raises(RuntimeError, match="without a perturbation"):
        pert.restore()
    pert.perturb(1, 0.1)
    with pytest.raises(RuntimeError, match="already perturbed"):
        pert.perturb(2, 0.1)
    with pytest.raises(RuntimeError, match="restore first"):
        pert.add_noise_sum([1], [0.1])
    pert.restore()
    with pytest.raises(ValueError, match="coefficients"):
        pert.add_noise_sum([1, 2], [0.1])
    with pytest.raises(ValueError, match="float32"):
        _single(torch.zeros(4, dtype=torch.bfloat16)).add_noise_sum([1], [0.1])


def test_chunked_generation_equals_whole_tensor(monkeypatch):
    import megarl.methods.gradients.perturbation as mp

    w = torch.randn(37, 11)
    whole = _single(w.clone())
    whole.perturb(5, 0.1)
    monkeypatch.setattr(mp, "CHUNK_ELEMENTS", 30)  # 2 rows per chunk
    chunked = _single(w.clone())
    assert len(list(chunked.maps[0].row_chunks())) == 19
    chunked.perturb(5, 0.1)
    assert torch.equal(whole.maps[0].param.data, chunked.maps[0].param.data)
    chunked.restore()
    assert torch.equal(chunked.maps[0].param.data, w)


def test_noise_sum_equals_reference_es_update():
    w = torch.randn(5, 7)
    pert = _single(w.clone(), "layer.w")
    pert.add_noise_sum([4, 9], [0.3, -0.1])
    # the reference with rewards whose coefficients are (0.3, -0.1): lr/(M sigma) * R, M=2, sigma=1, lr=1
    want = rp.es_update({"layer.w": w}, [4, 9], [1.0, 1.0], torch.tensor([0.6, -0.2]), 1.0, 1.0, "none")
    assert torch.equal(pert.maps[0].param.data, want["layer.w"])
    assert isinstance(pert.maps[0], ParamNoise)
