"""Per-sequence (varlen) attention of packed rows on the CPU path equals the dense block-diagonal
mask path and one-sequence-at-a-time forwards: logprobs and parameter gradients, dense and MoE."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.learner.forward import packed_inputs, run_model
from megarl.learner.model import build_gpt_model, cpu_varlen
from megarl.learner.parallel import ParallelLayout, initialize_parallel
from megarl.learner.varlen_attention import segment_plan, varlen_attention
from megarl.testing.tiny_qwen3 import TINY_QWEN3_HF

VOCAB = 64
TOL = 2e-5


def _hf(moe: bool) -> dict:
    hf = dict(
        TINY_QWEN3_HF,
        model_type="qwen3_moe" if moe else "qwen3",
        vocab_size=VOCAB,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    if moe:
        hf.update(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    return hf


_MODELS: dict[bool, torch.nn.Module] = {}


def _model(moe: bool) -> torch.nn.Module:
    if moe not in _MODELS:
        groups = initialize_parallel(ParallelLayout())
        torch.manual_seed(3)
        _MODELS[moe] = build_gpt_model(_hf(moe), groups)
    initialize_parallel(ParallelLayout())
    return _MODELS[moe]


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(torch.tensor(lens), 0)])


def _loss_and_grads(model, tokens, cu, weights, attention: str, pad_multiple: int = 1):
    """Sum over packed sequences of weights * next-token logprobs; the parameter gradients."""
    model.zero_grad(set_to_none=True)
    T = int(cu[-1])
    if attention == "single":  # each sequence on its own (one-sequence rows)
        parts = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            inp = packed_inputs(tokens[a:b], torch.tensor([0, b - a]), torch.device("cpu"), attention="dense")
            parts.append(run_model(model, inp)[: b - a])
        logits = torch.cat(parts)
    else:
        inp = packed_inputs(tokens, cu, torch.device("cpu"), pad_multiple, attention=attention)
        logits = run_model(model, inp)[:T]
    logp = torch.log_softmax(logits.float(), -1)  # [T, V]
    loss = (logp * weights).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), grads


def _close(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_cpu_models_use_varlen_attention():
    assert cpu_varlen()
    model = _model(False)
    core = model.decoder.layers[0].self_attention.core_attention
    assert type(core).__name__ == "VarlenDotProductAttention"
    inp = packed_inputs(torch.arange(10), _cu([4, 6]), torch.device("cpu"))
    assert inp.attention_mask.tolist() == [0, 4, 10]  # boundaries, not a [T, T] mask


@settings(max_examples=6, deadline=None)
@given(
    lens=st.lists(st.integers(1, 12), min_size=1, max_size=7),
    moe=st.booleans(),
    pad=st.sampled_from([1, 8]),
    seed=st.integers(0, 99),
)
def test_packed_equals_dense_and_single(lens, moe, pad, seed):
    model = _model(moe)
    g = torch.Generator().manual_seed(seed)
    cu = _cu(lens)
    T = int(cu[-1])
    tokens = torch.randint(0, VOCAB, (T,), generator=g)
    weights = torch.randn(T, VOCAB, generator=g)
    lp_v, g_v = _loss_and_grads(model, tokens, cu, weights, "varlen", pad)
    lp_d, g_d = _loss_and_grads(model, tokens, cu, weights, "dense", pad)
    lp_s, g_s = _loss_and_grads(model, tokens, cu, weights, "single")
    assert float((lp_v - lp_d).abs().max()) < TOL
    assert float((lp_v - lp_s).abs().max()) < TOL
    assert _close(g_v, g_d) < TOL
    assert _close(g_v, g_s) < TOL


def _dense_reference(q, k, v, cu, scale):
    """Attention with an explicit block-diagonal causal mask (float64)."""
    T, _, nq, _ = q.shape
    rep = nq // k.shape[2]
    qd, kd, vd = q[:, 0].double(), k[:, 0].double().repeat_interleave(rep, 1), v[:, 0].double()
    vd = vd.repeat_interleave(rep, 1)
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    allowed = (seq[:, None] == seq[None, :]) & (torch.arange(T)[:, None] >= torch.arange(T)[None, :])
    s = torch.einsum("qhd,khd->hqk", qd, kd) * scale
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", p, vd).reshape(T, 1, -1)


@settings(max_examples=10, deadline=None)
@given(
    lens=st.lists(st.one_of(st.integers(1, 9), st.integers(60, 90)), min_size=1, max_size=6),
    seed=st.integers(0, 99),
)
def test_varlen_attention_matches_masked_softmax(lens, seed):
    """Short and long sequences mixed: one padded bucket or several."""
    g = torch.Generator().manual_seed(seed)
    cu = _cu(lens)
    T = int(cu[-1])
    q = torch.randn(T, 1, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(T, 1, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(T, 1, 2, 8, generator=g, requires_grad=True)
    w = torch.randn(T, 1, 32, generator=g)
    out = varlen_attention(q, k, v, cu, 0.3)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = _dense_reference(qd, kd, vd, cu, 0.3)
    ref_grads = torch.autograd.grad((ref * w.double()).sum(), (qd, kd, vd))
    assert float((out.detach().double() - ref.detach()).abs().max()) < 1e-5
    for a, b in zip(grads, ref_grads):
        assert float((a.double() - b).abs().max()) < 1e-5


def test_segment_plan_pads_similar_lengths_into_one_bucket():
    plan = segment_plan(_cu([3, 2, 3, 1]))  # longest first; padding repeats a row's last token
    assert [(b.n, b.length) for b in plan.buckets] == [(4, 3)]
    index, back = plan.buckets[0].index, plan.back
    assert index is not None and back is not None
    assert index.tolist() == [0, 1, 2, 5, 6, 7, 3, 4, 4, 8, 8, 8]
    assert back.tolist() == [0, 1, 2, 6, 7, 3, 4, 5, 9]  # each token's row in the padded output
    rect = segment_plan(_cu([4, 4, 4]))  # the row is already [3, 4]: no gathers
    assert [(b.n, b.length, b.index) for b in rect.buckets] == [(3, 4, None)] and rect.back is None
    apart = segment_plan(_cu([10, 300, 12]))  # padding 10 and 12 to 300 would cost > 1.25x: apart
    assert [(b.n, b.length) for b in apart.buckets] == [(1, 300), (2, 12)]


def test_varlen_attention_refuses_bad_boundaries():
    q = torch.randn(5, 1, 2, 4)
    with pytest.raises(ValueError, match="cu_seqlens ends at 4, the packed row has 5 tokens"):
        varlen_attention(q, q, q, _cu([4]), 0.5)
    with pytest.raises(ValueError, match="one packed row"):
        varlen_attention(torch.randn(5, 2, 2, 4), q, q, _cu([5]), 0.5)
    with pytest.raises(ValueError, match="allowed: auto, varlen, dense"):
        packed_inputs(torch.arange(5), _cu([5]), torch.device("cpu"), attention="flash")
