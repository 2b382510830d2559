"""OPD regulation: the estimator equals reference/distillation.py (advantages; loss and gradient with
the teacher at TP 1/2, DP 1/2, micro-batches) and the spec's invariants (compression odd, monotone,
|f| <= |x|, f'(0) = 1; clip bounds; no regulation = plain OPD; length diagnostic)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.distillation as rd
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.methods.distillation.opd_regulation import compress, length_correlation
from megarl.methods.distillation.opd_signal import Diagnostics
from megarl.testing.equivalence import megarl_loss_and_grad
from tests.methods.helpers import load_example
from tests.methods.teacher_advantages_harness import (
    check_equivalent,
    estimated,
    packed_of,
    padded_inputs,
    ppo_cfgs,
    teacher_batches,
    with_teacher_logprobs,
)
from tests.property.strategies import rl_cases

KNOBS = st.fixed_dictionaries(
    {
        "clip_low": st.sampled_from([0.5, 3.0, 1e9]),
        "clip_high": st.sampled_from([0.5, 3.0, 1e9]),
        "scale": st.sampled_from([0.5, 1.0, 4.0]),
        "compress_log": st.booleans(),
    }
)
EST = ADVANTAGE_ESTIMATORS.get("opd_regulation")


def _ref(knobs):
    k = dict(knobs, compress=knobs["compress_log"])
    del k["compress_log"]
    return k


@settings(max_examples=25, deadline=None)
@given(teacher_batches(), KNOBS)
def test_advantages_match_reference(b, knobs):
    _, teacher, old, mask = padded_inputs(b)
    want = packed_of(b, rd.opd_regulate(rd.opd_token_reward(teacher, old, mask), **_ref(knobs)) * mask)
    torch.testing.assert_close(EST(b, **knobs), want, rtol=1e-12, atol=1e-12)


@settings(max_examples=8, deadline=None)
@given(
    case=rl_cases(torch.float64, cfgs=ppo_cfgs()),
    knobs=KNOBS,
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_loss_and_gradient_match_reference(case, knobs, tp, dp, mb):
    def ref(pad, t, o):
        return rd.opd_regulate(
            rd.opd_token_reward(t, o, pad.loss_mask), **_ref(knobs)
        ) * pad.loss_mask, pad.loss_mask

    check_equivalent(case, tp, dp, mb, "opd_regulation", knobs, ref)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-50, 50), min_size=2, max_size=20), st.sampled_from([0.1, 1.0, 7.0]))
def test_compression_is_odd_monotone_and_shrinks(xs, s):
    x = torch.tensor(sorted(xs), dtype=torch.float64)
    f = compress(x, s)
    assert torch.equal(compress(-x, s), -f)
    assert bool((f[1:] >= f[:-1]).all()) and bool((f.abs() <= x.abs()).all())
    h = torch.tensor([1e-7, -1e-7], dtype=torch.float64)
    torch.testing.assert_close(compress(h, s) / h, torch.ones(2, dtype=torch.float64), rtol=1e-6, atol=0)


@settings(max_examples=20, deadline=None)
@given(teacher_batches(), KNOBS)
def test_clip_bounds_hold_and_no_regulation_is_plain_opd(b, knobs):
    adv = EST(b, **knobs)
    assert float(adv.clamp(min=0).sum()) == 0 or float(adv.max()) <= knobs["clip_high"]
    assert float(adv.clamp(max=0).sum()) == 0 or float(adv.min()) >= -knobs["clip_low"]
    ell = (b.teacher_logprobs - b.old_logprobs) * b.loss_mask
    assert torch.equal(EST(b, clip_low=float("inf"), clip_high=float("inf"), compress_log=False), ell)


@settings(max_examples=6, deadline=None)
@given(case=rl_cases(torch.float64, cfgs=ppo_cfgs()))
def test_on_policy_unregulated_gradient_is_sampled_reverse_kl(case):
    """At ratio 1 (one on-policy step), PPO on A = ℓ has exactly the gradient of the objective's
    plain on-policy distillation term (distill: sampled_reverse_kl, no policy loss)."""
    case = with_teacher_logprobs(case, 2)
    logp = torch.log_softmax(case.logits, -1).gather(-1, case.batch.tokens[:, None])[:, 0]
    case = dataclasses.replace(case, batch=dataclasses.replace(case.batch, old_logprobs=logp.clone()))
    ours = estimated(
        case, "opd_regulation", clip_low=float("inf"), clip_high=float("inf"), compress_log=False
    )
    _, g = megarl_loss_and_grad(ours, tp=2, micro_batches=2)
    cfg = dataclasses.replace(case.cfg, policy_loss="none", distill="sampled_reverse_kl", distill_coef=1.0)
    _, g_opd = megarl_loss_and_grad(dataclasses.replace(case, cfg=cfg), tp=2, micro_batches=2)
    torch.testing.assert_close(g, g_opd, rtol=1e-9, atol=1e-12)


def test_padding_with_zero_reward_tokens_keeps_the_per_token_contribution():
    from megarl.batch import from_sequences

    b = from_sequences([[1]], [[2, 3]], [0], rewards=[1.0])
    b.old_logprobs = torch.tensor([0.0, -1.0, -2.0], dtype=torch.float64)
    b.teacher_logprobs = torch.tensor([0.0, -3.0, -1.0], dtype=torch.float64)
    long = from_sequences([[1]], [[2, 3, 4, 5]], [0], rewards=[1.0])
    long.old_logprobs = torch.tensor([0.0, -1.0, -2.0, -0.5, -0.5], dtype=torch.float64)
    long.teacher_logprobs = torch.tensor([0.0, -3.0, -1.0, -0.5, -0.5], dtype=torch.float64)
    a, a_long = EST(b), EST(long)
    assert torch.equal(a_long[:3], a) and torch.equal(a_long[3:], torch.zeros(2, dtype=torch.float64))


def test_length_diagnostic_and_bad_knobs():
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    cu = torch.tensor([0, 1, 3, 6])
    assert length_correlation(adv, torch.ones(6), cu) == pytest.approx(1.0)  # longer: larger total
    assert length_correlation(torch.zeros(6, dtype=torch.float64), torch.ones(6), cu) == 0.0
    from megarl.batch import from_sequences

    b = from_sequences([[1], [1]], [[2], [3, 4]], [0, 0], rewards=[1.0, 0.0])
    b.old_logprobs = torch.zeros(5, dtype=torch.float64)
    b.teacher_logprobs = torch.full((5,), -2.0, dtype=torch.float64)
    s = Diagnostics()
    EST(b, clip_low=0.5, state=s)
    assert s.metrics()["opd_regulation/clipped_frac"] == 1.0 and s.metrics()[
        "opd_regulation/length_corr"
    ] == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="clip_low"):
        EST(b, clip_low=-1.0)
    with pytest.raises(ValueError, match="scale"):
        EST(b, scale=0.0)


def test_example_loads():
    assert load_example("opd-regulation")["advantage"]["estimator"] == "opd_regulation"
