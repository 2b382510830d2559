"""Each vocab-parallel op equals its full-vocabulary reference, value and gradient, at TP 1/2/4
(simulated ranks), with chunk sizes that do and do not divide T.

Tolerances: fp64 rtol 1e-10. fp32 rtol 1e-5 and atol 1e-5·max(1, |z|max): entropy and KL
gradients subtract quantities of the size of the logits (p·(z - Σ p z), p·(log p - log q - KL)),
so both sides carry an absolute rounding error of a few ulps of |z| (|z| = 60 gives ~4e-5)."""

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import reference.distillation as rd
import reference.logprobs as rl
from megarl.ops import vocab_parallel as vp
from megarl.testing.simulated_group import SimulatedWorld


@st.composite
def logit_pairs(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    T = draw(st.integers(1, 6))
    V = tp * draw(st.integers(1, 4))
    scale = draw(st.sampled_from([1.0, 10.0, 60.0]))
    el = st.floats(-1, 1, allow_nan=False, width=32)
    a = draw(arrays(np.float64, (T, V), elements=el)) * scale
    b = draw(arrays(np.float64, (T, V), elements=el)) * scale
    tg = draw(arrays(np.int64, (T,), elements=st.integers(0, V - 1)))
    w = draw(arrays(np.float64, (2, T), elements=st.floats(-2, 2, width=32)))
    chunk = draw(st.integers(1, 7))
    return tp, torch.tensor(a), torch.tensor(b), torch.tensor(tg), torch.tensor(w), chunk


def _sharded(tp, fn):
    outs = SimulatedWorld(tp).run(fn)
    for o in outs[1:]:
        for x, y in zip(o[0], outs[0][0]):
            assert torch.equal(x, y), "TP ranks disagree on a per-token result"
    return outs[0][0], tuple(torch.cat([o[1][i] for o in outs], -1) for i in range(len(outs[0][1])))


def _run_all(tp, a, b, tg, w, chunk):
    def fn(r, g):
        xa = a.chunk(tp, -1)[r].clone().requires_grad_()
        xb = b.chunk(tp, -1)[r].clone().requires_grad_()
        lp, ent = vp.vocab_parallel_logprobs_entropy(xa, tg, g, chunk)
        lse = vp.vocab_parallel_logsumexp(xa, g, chunk)
        kl = vp.vocab_parallel_kl(xa, xb, g, chunk)
        h2 = vp.vocab_parallel_hellinger_sq(xa, xb, g, chunk)
        ent_only = vp.vocab_parallel_entropy(xb, g, chunk)
        lp_only = vp.vocab_parallel_logprobs(xb, tg, g, chunk)
        # in-place backward (gradient written over a copy of the logits) gives the same gradient
        xc, xd = xb.detach().clone().requires_grad_(), xb.detach().clone().requires_grad_()
        (
            w[0] * vp.vocab_parallel_logprobs_entropy(xc * 1.0, tg, g, chunk, inplace_backward=True)[0]
        ).sum().backward()
        (w[0] * vp.vocab_parallel_logprobs_entropy(xd, tg, g, chunk)[0]).sum().backward()
        assert torch.equal(xc.grad, xd.grad)
        (
            w[0] * lp + w[1] * ent + w[0] * lse + w[1] * kl + w[0] * h2 + w[1] * ent_only + w[0] * lp_only
        ).sum().backward()
        vals = (lp, ent, lse, kl, h2, ent_only, lp_only)
        return tuple(v.detach() for v in vals), (xa.grad, xb.grad)

    return _sharded(tp, fn)


def _reference(a, b, tg, w):
    a = a.clone().requires_grad_()
    b = b.clone().requires_grad_()
    lp = rl.token_logprobs(a, tg)
    ent = rl.entropy(a)
    lse = rl.logsumexp(a)
    kl = rd.reverse_kl(a, b)  # KL(p_a || p_b)
    h2 = rd.hellinger_sq(a, b)
    ent_only = rl.entropy(b)
    lp_only = rl.token_logprobs(b, tg)
    (
        w[0] * lp + w[1] * ent + w[0] * lse + w[1] * kl + w[0] * h2 + w[1] * ent_only + w[0] * lp_only
    ).sum().backward()
    return (lp, ent, lse, kl, h2, ent_only, lp_only), (a.grad, b.grad)


@given(logit_pairs())
def test_ops_match_reference_fp64(args):
    tp, a, b, tg, w, chunk = args
    vals, grads = _run_all(tp, a, b, tg, w, chunk)
    rvals, rgrads = _reference(a, b, tg, w)
    for x, y in zip(vals + grads, rvals + rgrads):
        y = y.detach()
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10 * max(1.0, float(y.abs().max())))


@given(logit_pairs())
def test_ops_match_reference_fp32(args):
    tp, a, b, tg, w, chunk = args
    a, b, w = a.float(), b.float(), w.float()
    vals, grads = _run_all(tp, a, b, tg, w, chunk)
    rvals, rgrads = _reference(a, b, tg, w)
    zmax = max(1.0, float(a.abs().max()), float(b.abs().max()))
    for x, y in zip(vals + grads, rvals + rgrads):
        y = y.detach()
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * max(zmax, float(y.abs().max())))


@given(logit_pairs(), st.integers(1, 5))
def test_topk_matches_full_vocabulary(args, k):
    tp, a, _, _, _, _ = args
    k = min(k, a.shape[-1])
    a = a.round()  # many ties: the tie order must match torch.topk on the full logits
    outs = SimulatedWorld(tp).run(lambda r, g: vp.vocab_parallel_topk(a.chunk(tp, -1)[r], k, g))
    rv, _ = rl.topk(a, k)
    for v, i in outs:
        assert torch.equal(v, rv)
        assert torch.equal(torch.gather(a, -1, i), rv)  # ids point at equal values (ties may differ)
