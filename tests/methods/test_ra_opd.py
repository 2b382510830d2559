"""RA-OPD: the estimator equals reference/distillation.py (advantages and kept trajectories; loss and
gradient with the teacher at TP 1/2, DP 1/2, micro-batches, normalised by the kept tokens only) and
the spec's invariants."""

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.distillation as rd
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.batch import from_sequences
from megarl.methods.distillation.opd_signal import Diagnostics
from tests.methods.helpers import load_example
from tests.methods.teacher_advantages_harness import (
    check_equivalent,
    packed_of,
    padded_inputs,
    ppo_cfgs,
    teacher_batches,
)
from tests.property.strategies import rl_cases

KNOBS = st.fixed_dictionaries({"threshold": st.sampled_from([0.0, 0.5]), "returns_to_go": st.booleans()})
EST = ADVANTAGE_ESTIMATORS.get("ra_opd")


def _ref(pad, teacher, old, knobs):
    ell = rd.opd_token_reward(teacher, old, pad.loss_mask)
    ok = pad.per_seq["rewards"] > knobs["threshold"]
    kept = rd.ra_opd_keep(ell, pad.loss_mask, ok)
    adv = rd.ra_opd_advantages(ell, pad.loss_mask, ok, knobs["returns_to_go"])
    return adv, pad.loss_mask * kept[:, None].to(pad.loss_mask.dtype)


@settings(max_examples=25, deadline=None)
@given(teacher_batches(), KNOBS)
def test_advantages_and_loss_mask_match_reference(b, knobs):
    pad, teacher, old, _ = padded_inputs(b)
    adv, mask = _ref(pad, teacher, old, knobs)
    got = EST(b, **knobs)
    torch.testing.assert_close(got, packed_of(b, adv), rtol=1e-12, atol=1e-12)
    assert torch.equal(b.loss_mask, packed_of(b, mask))  # dropped trajectories left the loss


@settings(max_examples=8, deadline=None)
@given(
    case=rl_cases(torch.float64, cfgs=ppo_cfgs()),
    knobs=KNOBS,
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_loss_and_gradient_match_reference(case, knobs, tp, dp, mb):
    check_equivalent(case, tp, dp, mb, "ra_opd", knobs, lambda pad, t, o: _ref(pad, t, o, knobs))


@settings(max_examples=20, deadline=None)
@given(teacher_batches())
def test_all_kept_is_plain_opd_and_dropped_sequences_carry_nothing(b):
    ell = (b.teacher_logprobs - b.old_logprobs) * b.loss_mask
    mask0 = b.loss_mask.clone()
    c = dataclasses.replace(b)
    adv = EST(c)
    seq = b.seq_index()
    dropped = (mask0 > 0) & (c.loss_mask == 0)
    assert torch.equal(adv[dropped], torch.zeros_like(adv[dropped]))
    kept_seq = torch.unique(seq[(mask0 > 0) & ~dropped])
    sel = torch.isin(seq, kept_seq)
    assert torch.equal(adv[sel], ell[sel])  # a kept trajectory's advantages are OPD's exactly


def test_a_correct_trajectory_the_teacher_dislikes_is_dropped():
    b = from_sequences(
        [[1], [1], [1], [1]], [[2, 3], [2, 3], [4], [4]], [0, 0, 1, 1], rewards=[1.0, 1.0, 0.0, 0.0]
    )
    b.old_logprobs = torch.tensor([0, -1.0, -1.0, 0, -1.0, -1.0, 0, -1.0, 0, -1.0], dtype=torch.float64)
    # correct: D = +0.5 (kept), D = -0.5 (dropped); incorrect: D = -2 (kept), D = +1 (dropped)
    b.teacher_logprobs = torch.tensor([0, -0.5, -1.0, 0, -1.5, -1.0, 0, -3.0, 0, 0.0], dtype=torch.float64)
    s = Diagnostics()
    adv = EST(b, state=s)
    assert b.loss_mask.tolist() == [0, 1, 1, 0, 0, 0, 0, 1, 0, 0]
    torch.testing.assert_close(adv, torch.tensor([0, 0.5, 0, 0, 0, 0, 0, -2.0, 0, 0], dtype=torch.float64))
    m = s.metrics()
    assert (
        m["ra_opd/kept_frac"] == 0.5
        and m["ra_opd/dropped_correct"] == 1
        and m["ra_opd/dropped_incorrect"] == 1
    )


def test_teacher_temperature_matters_only_through_the_sign():
    b = from_sequences([[1], [1]], [[2, 3], [4]], [0, 0], rewards=[1.0, 0.0])
    b.old_logprobs = torch.tensor([0, -1.0, -2.0, 0, -1.0], dtype=torch.float64)
    b.teacher_logprobs = torch.tensor([0, -0.5, -1.0, 0, -2.0], dtype=torch.float64)
    sharper = dataclasses.replace(
        b, teacher_logprobs=b.old_logprobs + 3 * (b.teacher_logprobs - b.old_logprobs)
    )
    EST(b)
    EST(sharper)
    assert torch.equal(b.loss_mask, sharper.loss_mask)


def test_an_all_dropped_step_reports_its_batch_metrics():
    """Every trajectory dropped: no loss token is left, and the step's batch metrics still report."""
    from megarl.trainer.step_metrics import batch_metrics

    b = from_sequences([[1], [1]], [[2], [3]], [0, 0], rewards=[1.0, 0.0])
    b.old_logprobs = torch.zeros(4, dtype=torch.float64)
    b.rollout_logprobs = torch.zeros(4, dtype=torch.float64)
    b.teacher_logprobs = torch.tensor([0.0, -1.0, 0.0, 1.0], dtype=torch.float64)  # both disagree
    b.advantages = EST(b).float()
    assert float(b.loss_mask.sum()) == 0
    rec = batch_metrics(b)
    assert rec["adv/abs_max"] == 0.0 and rec["adv/std"] == 0.0


def test_example_loads():
    assert load_example("ra-opd")["advantage"]["estimator"] == "ra_opd"


def test_needs_the_same_teacher_pass_as_opd():
    """No extra cost: RA-OPD's inputs are plain OPD's (one teacher forward, sampled tokens only)."""
    from megarl.trainer.config_loading import load_config
    from megarl.trainer.method_runtime import required_inputs
    from tests.methods.helpers import EXAMPLES

    ra = load_config(EXAMPLES / "ra-opd.yaml")
    opd = load_config(EXAMPLES / "core-onpolicy-distill.yaml")
    assert set(required_inputs(ra)) == set(required_inputs(opd)) == {"teacher_logprobs"}
