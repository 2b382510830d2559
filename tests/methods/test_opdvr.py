"""OPDVR and GRPD: the estimators equal reference/distillation.py (advantages; loss and gradient with
the teacher at TP 1/2, DP 1/2, micro-batches) and the spec's invariants (sign by verdict, |r| <= |l|,
r = l where the signs agree, gate off = OPD, GRPD zero on uniform groups with u = 0)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.distillation as rd
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.batch import from_sequences
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

GATES = st.sampled_from(["correctness", "inverse", "off"])
OPDVR_KNOBS = st.fixed_dictionaries({"gate": GATES, "threshold": st.sampled_from([0.0, 0.5])})
GRPD_KNOBS = st.fixed_dictionaries(
    {
        "gate": GATES,
        "threshold": st.sampled_from([0.0, 0.5]),
        "scale_by_std": st.booleans(),
        "baseline": st.sampled_from([0.0, 0.3]),
    }
)


def _ref(name, pad, teacher, old, knobs):
    ell = rd.opd_token_reward(teacher, old, pad.loss_mask)
    r, gid = seq_rewards(pad)
    ok = r > knobs["threshold"]
    if name == "opdvr":
        return rd.opdvr_rewards(ell, ok, knobs["gate"])
    k = {key: knobs[key] for key in ("gate", "scale_by_std", "baseline")}
    return rd.grpd_rewards(ell, r, gid, ok, **k)


@settings(max_examples=25, deadline=None)
@given(teacher_batches(), st.sampled_from(["opdvr", "grpd"]), st.data())
def test_advantages_match_reference(b, name, data):
    knobs = data.draw(OPDVR_KNOBS if name == "opdvr" else GRPD_KNOBS)
    pad, teacher, old, _ = padded_inputs(b)
    want = packed_of(b, _ref(name, pad, teacher, old, knobs))
    torch.testing.assert_close(ADVANTAGE_ESTIMATORS.get(name)(b, **knobs), want, rtol=1e-12, atol=1e-12)


@settings(max_examples=10, deadline=None)
@given(
    case=rl_cases(torch.float64, cfgs=ppo_cfgs()),
    name=st.sampled_from(["opdvr", "grpd"]),
    data=st.data(),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_loss_and_gradient_match_reference(case, name, data, tp, dp, mb):
    knobs = data.draw(OPDVR_KNOBS if name == "opdvr" else GRPD_KNOBS)
    check_equivalent(
        case, tp, dp, mb, name, knobs, lambda pad, t, o: (_ref(name, pad, t, o, knobs), pad.loss_mask)
    )


@settings(max_examples=30, deadline=None)
@given(teacher_batches())
def test_verdict_sets_the_sign_and_the_teacher_the_magnitude(b):
    r = ADVANTAGE_ESTIMATORS.get("opdvr")(b)
    ell = (b.teacher_logprobs - b.old_logprobs) * b.loss_mask
    ok = (b.rewards > 0)[b.seq_index()]
    assert bool((r[ok] >= 0).all()) and bool((r[~ok] <= 0).all())
    assert bool((r.abs() <= ell.abs()).all())
    agree = torch.where(ok, ell >= 0, ell <= 0)
    assert torch.equal(r[agree], ell[agree])
    assert torch.equal(ADVANTAGE_ESTIMATORS.get("opdvr")(b, gate="off"), ell)  # gate off: plain OPD


@settings(max_examples=20, deadline=None)
@given(teacher_batches())
def test_grpd_is_zero_on_uniform_groups_and_scales_opdvr(b):
    g = ADVANTAGE_ESTIMATORS.get("grpd")(b)
    o = ADVANTAGE_ESTIMATORS.get("opdvr")(b)
    seq = b.seq_index()
    for gid in torch.unique(b.group_ids):
        members = b.group_ids == gid
        rs = b.rewards[members]
        tok = members[seq]
        if bool(rs.max() == rs.min()):
            assert torch.equal(g[tok], torch.zeros_like(g[tok]))
    assert bool((g * o >= 0).all())  # the same sign as OPDVR's: the scale |A| + u is never negative


def test_gates_on_a_hand_case_and_bad_knobs():
    b = from_sequences([[1], [1]], [[2, 3], [4, 5]], [0, 0], rewards=[1.0, 0.0])
    b.old_logprobs = torch.tensor([0, -1.0, -1.0, 0, -1.0, -1.0], dtype=torch.float64)
    b.teacher_logprobs = torch.tensor([0, -0.5, -2.0, 0, -0.5, -2.0], dtype=torch.float64)  # ℓ = +0.5, -1
    est = ADVANTAGE_ESTIMATORS.get("opdvr")
    assert est(b).tolist() == [0, 0.5, 0, 0, 0, -1.0]
    assert est(b, gate="inverse").tolist() == [0, 0, -1.0, 0, 0.5, 0]
    # GRPD, Dr.GRPO advantages ±0.5: scale 0.5 (+ u)
    assert ADVANTAGE_ESTIMATORS.get("grpd")(b, baseline=0.5).tolist() == [0, 0.5, 0, 0, 0, -1.0]
    with pytest.raises(ValueError, match="advantage.gate"):
        est(b, gate="both")
    with pytest.raises(ValueError, match="advantage.baseline"):
        ADVANTAGE_ESTIMATORS.get("grpd")(b, baseline=-1.0)


def test_examples_load():
    assert load_example("opdvr")["advantage"]["estimator"] == "opdvr"
    assert load_example("grpd")["advantage"]["estimator"] == "grpd"


@pytest.mark.parametrize("example", ["opdvr", "grpd", "distilled-rl", "opd-regulation", "ra-opd"])
def test_a_run_without_a_teacher_is_refused_naming_who_needs_it(example):
    """The teacher-shaped estimators read teacher_logprobs: without teacher.hf_dir building the
    teacher refuses, naming the estimator (objective.distill is 'none' in these examples)."""
    from megarl.plugin.core_inputs import teacher_hf_config
    from megarl.trainer.config_loading import load_config
    from tests.methods.helpers import EXAMPLES

    cfg = load_config(EXAMPLES / f"{example}.yaml")
    est = cfg.advantage.estimator
    with pytest.raises(ValueError, match=rf"advantage\.estimator='{est}'.*needs? teacher\.hf_dir"):
        teacher_hf_config(cfg, {"vocab_size": 16})
