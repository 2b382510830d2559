"""Distilled RL: the estimator equals reference/distillation.py (advantages; loss and gradient with
the teacher at TP 1/2, DP 1/2, micro-batches) and the method's invariants."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.distillation as rd
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import grpo
from megarl.methods.distillation.distilled_rl import distilled_rl_weights
from megarl.methods.distillation.opd_signal import Diagnostics
from tests.methods.helpers import load_example
from tests.methods.teacher_advantages_harness import (
    check_equivalent,
    packed_of,
    padded_inputs,
    ppo_cfgs,
    seq_rewards,
    teacher_batches,
)
from tests.property.strategies import rl_cases

KNOBS = st.fixed_dictionaries(
    {
        "rho_clip": st.sampled_from([1.2, 3.0]),
        "normalized": st.booleans(),
        "sample": st.sampled_from(["positive", "negative", "all"]),
        "scale_by_std": st.booleans(),
    }
)
EST = ADVANTAGE_ESTIMATORS.get("distilled_rl")


def _ref_adv(b_or_pad, teacher, old, knobs):
    r, gid = seq_rewards(b_or_pad)
    return rd.distilled_rl_advantages(r, gid, teacher, old, b_or_pad.loss_mask, **knobs)


@settings(max_examples=25, deadline=None)
@given(teacher_batches(), KNOBS)
def test_advantages_match_reference(b, knobs):
    pad, teacher, old, _ = padded_inputs(b)
    want = packed_of(b, _ref_adv(pad, teacher, old, knobs))
    torch.testing.assert_close(EST(b, **knobs), want, rtol=1e-10, atol=1e-12)


@settings(max_examples=8, deadline=None)
@given(
    case=rl_cases(torch.float64, cfgs=ppo_cfgs()),
    knobs=KNOBS,
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_loss_and_gradient_match_reference(case, knobs, tp, dp, mb):
    check_equivalent(
        case, tp, dp, mb, "distilled_rl", knobs, lambda pad, t, o: (_ref_adv(pad, t, o, knobs), pad.loss_mask)
    )


@settings(max_examples=20, deadline=None)
@given(teacher_batches(), KNOBS)
def test_teacher_equal_to_old_policy_is_grpo(b, knobs):
    b.teacher_logprobs = b.old_logprobs.clone()
    base = grpo(b.rewards.double(), b.group_ids, knobs["scale_by_std"])[b.seq_index()] * b.loss_mask
    assert torch.equal(EST(b, **knobs), base)


@settings(max_examples=20, deadline=None)
@given(teacher_batches(), st.sampled_from([1.2, 3.0]))
def test_positive_only_geometric_mean_one_and_clip_bounds(b, rho_clip):
    a = grpo(b.rewards.double(), b.group_ids)
    lr = b.teacher_logprobs - b.old_logprobs
    w = distilled_rl_weights(lr, b.loss_mask, b.cu_seqlens, a, rho_clip, True, "positive")
    m, seq = b.loss_mask.bool(), b.seq_index()
    pos = a[seq] > 0
    assert torch.equal(w[~(pos & m)], torch.ones_like(w[~(pos & m)]))  # A ≤ 0 and padding: weight 1
    for i in torch.unique(seq[pos & m]).tolist():
        sel = (seq == i) & m
        assert abs(float(torch.log(w[sel]).mean())) < 1e-12  # geometric mean 1 per positive response
        assert float(w[sel].max()) <= rho_clip**2 + 1e-9 and float(w[sel].min()) >= rho_clip**-2 - 1e-12
    raw = distilled_rl_weights(lr, b.loss_mask, b.cu_seqlens, a, rho_clip, False, "all")
    assert float(raw.max()) <= rho_clip * (1 + 1e-12) and float(raw.min()) >= (1 - 1e-12) / rho_clip


def test_weights_are_constants_of_the_loss_and_clip_at_the_bound():
    from megarl.batch import from_sequences

    b = from_sequences([[1], [1]], [[2, 3, 4], [5]], [0, 0], rewards=[1.0, 0.0])
    b.old_logprobs = torch.tensor([0.0, -1.0, -1.0, -1.0, 0.0, -1.0], dtype=torch.float64, requires_grad=True)
    b.teacher_logprobs = torch.tensor([0.0, -0.1, -1.0, -200.0, 0.0, -3.0], dtype=torch.float64)
    st = Diagnostics()
    adv = EST(b, normalized=False, state=st)
    assert not adv.requires_grad
    a = grpo(torch.tensor([1.0, 0.0], dtype=torch.float64), b.group_ids)
    # response 0 (A > 0): ρ = e^{0.9} clipped to 3? no (2.46 < 3); 1; e^{-199} clipped to 1/3
    want0 = a[0] * torch.tensor([math.exp(0.9), 1.0, 1 / 3], dtype=torch.float64)
    torch.testing.assert_close(adv[1:4], want0, rtol=1e-12, atol=0)
    assert adv[5] == a[1]  # A < 0: unchanged
    assert st.metrics()["distilled_rl/weight_min"] == pytest.approx(1 / 3)


def test_bad_knobs_and_missing_teacher_are_named():
    from megarl.batch import from_sequences

    b = from_sequences([[1], [1]], [[2], [3]], [0, 0], rewards=[1.0, 0.0])
    b.old_logprobs = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        EST(b)
    b.teacher_logprobs = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="rho_clip"):
        EST(b, rho_clip=1.0)
    with pytest.raises(ValueError, match="sample"):
        EST(b, sample="best")


def test_example_loads():
    cfg = load_example("distilled-rl")
    assert cfg["advantage"]["estimator"] == "distilled_rl" and cfg["objective"]["policy_loss"] == "ppo"
