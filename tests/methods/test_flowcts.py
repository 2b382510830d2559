"""FlowCTS on the tiny flow model: L_N and the KL-OPD baseline, loss and gradient, equal
reference/flow.py (per-sample loops) and micro-batch / data-parallel splits add up; v_S ≡ v_R
gives 0; w(u) >= 0 and non-increasing; the discrete trajectory bound holds on random smooth
fields; N = 1 is the weighted velocity MSE at the visited state."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.flow as rf
from megarl.methods.gradients.flowcts import (
    FlowCTSHook,
    FlowCTSKnobs,
    cts_weight,
    field_of,
    flowcts_terms,
    kl_opd_terms,
)
from tests.methods.helpers import EXAMPLES, assert_splits_add_up, velocity_model

_model = velocity_model


def _one(f):
    return lambda x, u: f(x[None], torch.tensor([u], dtype=x.dtype))[0]


def _states(seed: int, n: int = 5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g, dtype=torch.float64)
    return x, torch.rand(n, generator=g, dtype=torch.float64) * 0.9


@settings(max_examples=6, deadline=None)
@given(
    st.integers(0, 2**16),
    st.integers(1, 4),
    st.booleans(),
    st.sampled_from(["flowcts", "kl_opd"]),
    st.integers(1, 3),
)
def test_loss_and_gradient_equal_the_reference_and_splits_add_up(seed, n, own, objective, parts):
    student, ref = _model(seed), _model(seed + 1)
    f_s, f_r = field_of(student), field_of(ref)
    x, t_k = _states(seed)

    def terms(xs, ts):
        if objective == "flowcts":
            return flowcts_terms(f_s, f_r, xs, ts, n, own, through_path=True)
        return kl_opd_terms(f_s, f_r, xs, ts, n, 0.7, through_path=True)

    loss = terms(x, t_k).mean()
    grads = torch.autograd.grad(loss, list(student.parameters()))
    ref_terms = [
        rf.flowcts_loss(_one(f_s), _one(f_r), x[i], float(t_k[i]), n, own)
        if objective == "flowcts"
        else rf.kl_opd_loss(_one(f_s), _one(f_r), x[i], float(t_k[i]), n, 0.7)
        for i in range(len(x))
    ]
    ref_loss = torch.stack(ref_terms).mean()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    for g, r in zip(grads, torch.autograd.grad(ref_loss, list(student.parameters()))):
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-12)
    splits = torch.arange(len(x)).tensor_split(parts)  # micro-batches / replicas, whole-batch mean
    assert_splits_add_up(
        loss, grads, student.parameters(), (terms(x[p], t_k[p]).sum() / len(x) for p in splits)
    )


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 6), st.booleans())
def test_identical_fields_give_zero(seed, n, own):
    m = _model(seed)
    x, t_k = _states(seed)
    assert float(flowcts_terms(field_of(m), field_of(m), x, t_k, n, own).abs().max()) == 0.0


@settings(max_examples=25, deadline=None)
@given(st.floats(0, 0.99), st.floats(0, 1), st.floats(0, 1))
def test_weight_is_nonnegative_and_nonincreasing(t_k, a, b):
    u1, u2 = sorted((t_k + a * (1 - t_k), t_k + b * (1 - t_k)))
    w1, w2 = rf.cts_weight(u1, t_k), rf.cts_weight(u2, t_k)
    assert w1 >= 0 and w2 >= -1e-15 and w1 >= w2
    got = cts_weight(torch.tensor([u1, u2]), torch.tensor(t_k))
    torch.testing.assert_close(got, torch.tensor([w1, w2]), rtol=1e-6, atol=1e-7)


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from([1, 4, 16, 64]), st.floats(0, 0.9))
def test_discrete_trajectory_bound_holds_on_random_smooth_fields(seed, n, t_k):
    """Σ_j h ‖x^S_j − x^R_j‖² <= L_N, each field on its own Euler path from the same start."""
    f_s, f_r = _one(field_of(_model(seed))), _one(field_of(_model(seed + 7)))
    x = _states(seed, 1)[0][0]
    with torch.no_grad():
        lhs = rf.trajectory_discrepancy(f_s, f_r, x, t_k, n)
        rhs = rf.flowcts_loss(f_s, f_r, x, t_k, n, own_paths=True)
    assert float(lhs) <= float(rhs) * (1 + 1e-12) + 1e-15, (float(lhs), float(rhs))


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**16))
def test_single_state_is_the_weighted_velocity_mse(seed):
    s, r = _model(seed), _model(seed + 3)
    x, t_k = _states(seed)
    want = cts_weight(t_k, t_k) * ((field_of(s)(x, t_k) - field_of(r)(x, t_k)) ** 2).sum(-1) * (1 - t_k)
    for own in (True, False):
        torch.testing.assert_close(
            flowcts_terms(field_of(s), field_of(r), x, t_k, 1, own), want, rtol=1e-12, atol=0
        )


def test_one_step_distils_and_the_state_round_trips():
    k = FlowCTSKnobs(pretrain_steps=0, reference_pretrain_steps=0, hidden=8, steps=3, batch=6, updates=1)
    hook = FlowCTSHook(k)
    assert hook.updates_policy(1) is False
    ref_before = [p.clone() for p in hook.reference.parameters()]
    m = hook.after_step(1, {})
    assert m["flowcts/update_norm"] > 0 and m["flowcts/flowcts_loss"] > 0, m
    assert all(torch.equal(p, q) for p, q in zip(ref_before, hook.reference.parameters()))  # fixed
    other = FlowCTSHook(k)
    other.load_state_dict(copy.deepcopy(hook.state_dict()))
    assert other.after_step(2, {}) == hook.after_step(2, {})


def test_knobs_are_checked_and_the_example_loads():
    with pytest.raises(ValueError, match="method.objective"):
        FlowCTSKnobs(objective="sft").check()
    with pytest.raises(ValueError, match="method.supervision"):
        FlowCTSKnobs(supervision=0).check()
    cfg = yaml.safe_load((EXAMPLES / "flowcts.yaml").read_text())
    assert cfg["method"]["name"] == "flowcts" and cfg["base"] == "../quickstart.yaml"
    assert set(cfg["method"]) - {"name"} <= set(FlowCTSKnobs.__dataclass_fields__)
