"""The fused output layer (megarl.ops.fused_output) equals the reference on the full logits
``hidden @ weight.T``: logprobs, entropies and the gradients of hidden states and output weight,
at TP 1 and 2 (simulated ranks: each holds its rows of the weight), with chunk sizes that do and do
not divide T.

Tolerances: fp64 rtol 1e-9 / atol 1e-9·max(1, |z|max) (the two sides sum the same products in a
different order); fp32 against the unfused vocab-parallel op on the same logits: 1e-5 relative to
the largest logit or gradient.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import reference.logprobs as rl
from megarl.ops.fused_output import fused_logprobs_entropy
from megarl.ops.vocab_parallel import vocab_parallel_logprobs_entropy
from megarl.testing.simulated_group import SimulatedWorld


@st.composite
def cases(draw):
    tp = draw(st.sampled_from([1, 2]))
    T = draw(st.integers(1, 9))
    H = draw(st.integers(1, 5))
    V = tp * draw(st.integers(1, 4))
    scale = draw(st.sampled_from([1.0, 4.0, 12.0]))
    el = st.floats(-1, 1, allow_nan=False, width=32)
    h = draw(arrays(np.float64, (T, H), elements=el)) * scale
    w = draw(arrays(np.float64, (V, H), elements=el))
    tg = draw(arrays(np.int64, (T,), elements=st.integers(0, V - 1)))
    gw = draw(arrays(np.float64, (2, T), elements=st.floats(-2, 2, width=32)))
    chunk = draw(st.sampled_from([1, 2, 3, 4, T, T + 5]))  # divides T or not, one chunk or many
    with_entropy = draw(st.booleans())
    return tp, torch.tensor(h), torch.tensor(w), torch.tensor(tg), torch.tensor(gw), chunk, with_entropy


def _fused(tp, h, w, tg, gw, chunk, with_entropy):
    """Per-token results (checked equal on all ranks), the hidden gradient (same on all ranks) and
    the weight gradient gathered in rank order."""

    def fn(r, g):
        x = h.clone().requires_grad_()
        wr = w.chunk(tp, 0)[r].clone().requires_grad_()
        lp, ent = fused_logprobs_entropy(x, wr, tg, g, chunk, with_entropy=with_entropy)
        (gw[0] * lp + gw[1] * ent).sum().backward()
        return lp.detach(), ent.detach(), x.grad, wr.grad

    outs = SimulatedWorld(tp).run(fn)
    for o in outs[1:]:
        for a, b in zip(o[:3], outs[0][:3]):
            assert torch.equal(a, b), "TP ranks disagree on a per-token result or the hidden gradient"
    return outs[0][0], outs[0][1], outs[0][2], torch.cat([o[3] for o in outs], 0)


def _reference(h, w, tg, gw, with_entropy):
    x, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    logits = (x @ wr.T)[None]  # [1, T, V]
    lp = rl.token_logprobs(logits, tg[None])[0]
    ent = rl.entropy(logits)[0] if with_entropy else torch.zeros_like(lp)
    (gw[0] * lp + gw[1] * ent).sum().backward()
    return lp.detach(), ent.detach(), x.grad, wr.grad


@settings(max_examples=25, deadline=None)
@given(cases())
def test_fused_output_equals_reference_fp64(case):
    tp, h, w, tg, gw, chunk, with_entropy = case
    got = _fused(tp, h, w, tg, gw, chunk, with_entropy)
    want = _reference(h, w, tg, gw, with_entropy)
    zmax = float((h @ w.T).abs().max()) if h.numel() and w.numel() else 0.0
    for name, a, b in zip(("logprobs", "entropy", "grad hidden", "grad weight"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9 * max(1.0, zmax), msg=name)


@pytest.mark.parametrize("tp", [1, 2])
def test_fp32_matches_the_unfused_op_on_the_same_logits(tp):
    """What the learner swaps: output layer + vocab-parallel op vs the fused op, fp32, T=37 tokens
    in chunks of 8 (not dividing T)."""
    g = torch.Generator().manual_seed(0)
    T, H, V = 37, 16, 64
    h = torch.randn(T, H, generator=g) * 3
    w = torch.randn(V, H, generator=g)
    tg = torch.randint(0, V, (T,), generator=g)
    gw = torch.randn(2, T, generator=g)

    def fn(r, grp):
        outs = []
        for fused in (False, True):
            x = h.clone().requires_grad_()
            wr = w.chunk(tp, 0)[r].clone().requires_grad_()
            if fused:
                lp, ent = fused_logprobs_entropy(x, wr, tg, grp, 8)
            else:
                lp, ent = vocab_parallel_logprobs_entropy(x @ wr.T, tg, grp, 8)
            (gw[0] * lp + gw[1] * ent).sum().backward()
            outs.append((lp.detach(), ent.detach(), x.grad, wr.grad))
        return outs

    for unfused, fused in SimulatedWorld(tp).run(fn):
        for name, a, b in zip(("logprobs", "entropy", "grad hidden", "grad weight"), fused, unfused):
            # the unfused hidden gradient of one rank is its shard's part: the sum is over ranks
            if name == "grad hidden" and tp > 1:
                continue
            scale = max(1.0, float(b.abs().max()))
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_partial_hidden_gradient_sums_to_the_full_one():
    """``reduce_hidden_grad=False`` leaves each rank its own part; the parts sum to the gradient."""
    g = torch.Generator().manual_seed(1)
    h, w = (
        torch.randn(5, 3, generator=g, dtype=torch.float64),
        torch.randn(6, 3, generator=g, dtype=torch.float64),
    )
    tg = torch.tensor([0, 5, 2, 3, 1])

    def fn(r, grp, reduce):
        x = h.clone().requires_grad_()
        lp, ent = fused_logprobs_entropy(x, w.chunk(2, 0)[r], tg, grp, 2, reduce_hidden_grad=reduce)
        (lp + ent).sum().backward()
        return x.grad

    full = SimulatedWorld(2).run(lambda r, grp: fn(r, grp, True))
    parts = SimulatedWorld(2).run(lambda r, grp: fn(r, grp, False))
    torch.testing.assert_close(parts[0] + parts[1], full[0], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(parts[0], full[0])


def test_bad_shapes_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"hidden \(4, 3\) and weight \(5, 2\)"):
        fused_logprobs_entropy(torch.zeros(4, 3), torch.zeros(5, 2), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        fused_logprobs_entropy(torch.zeros(4, 3), torch.zeros(5, 3), torch.zeros(3, dtype=torch.long))


@settings(max_examples=20, deadline=None)
@given(
    st.sampled_from([1, 2]),
    st.integers(1, 9),
    st.integers(1, 4),
    st.integers(1, 6),
    st.sampled_from([1, 3, 4, 20]),
    st.integers(0, 2**16),
)
def test_fused_topk_equals_reference(tp, T, per_rank, k, chunk, seed):
    """Top-K ids and log-probabilities from hidden states vs reference topk/logsumexp on the full
    logits (random normal values: no ties), k above and below V/tp."""
    from megarl.ops.fused_output import fused_topk_logprobs

    g = torch.Generator().manual_seed(seed)
    V, H = tp * per_rank, 3
    h = torch.randn(T, H, generator=g, dtype=torch.float64) * 3
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    k = min(k, V)
    outs = SimulatedWorld(tp).run(lambda r, grp: fused_topk_logprobs(h, w.chunk(tp, 0)[r], k, grp, chunk))
    logits = h @ w.T
    vals, ids = rl.topk(logits, k)
    for got_ids, got_lp in outs:
        assert torch.equal(got_ids, ids)
        torch.testing.assert_close(got_lp, vals - rl.logsumexp(logits).unsqueeze(-1), rtol=1e-12, atol=1e-12)
