"""AMRP: the packed, DP-aware shaper equals reference/reward_shaping.py step by step; the method's
invariants: simplex with floor, uniform under identical statistics, η = 0 freezes, saturated
dimension -> w_min, permutation equivariance, no gradient, DP=2 equals DP=1, checkpoint round trip."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.reward_shaping as rr
from megarl.rewards.shaping import build_reward_shaping
from megarl.rewards.shaping.amrp import AMRP
from megarl.testing.simulated_group import SimulatedWorld
from tests.methods.helpers import load_example


@st.composite
def reward_streams(draw, K=None):
    K = K or draw(st.integers(1, 4))
    steps = draw(st.integers(1, 5))
    B = draw(st.integers(2, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["binary", "uniform"]))
    if kind == "binary":
        return [torch.randint(0, 2, (B, K), generator=g).double() for _ in range(steps)]
    return [torch.rand(B, K, generator=g, dtype=torch.float64) for _ in range(steps)]


KNOBS = st.fixed_dictionaries(
    {
        "eta": st.sampled_from([0.0, 0.1, 0.5]),
        "window": st.sampled_from([1, 3, 10]),
        "normalise": st.sampled_from(["minmax", "z"]),
        "beta": st.sampled_from([0.0, 0.9]),
    }
)


@settings(max_examples=20)
@given(reward_streams(), KNOBS, st.booleans())
def test_matches_reference_step_by_step_and_weights_on_the_simplex(stream, knobs, bounds):
    K = stream[0].shape[1]
    if bounds:
        knobs = {**knobs, "r_min": [0.0] * K, "r_max": [1.0] * K}
    amrp, state = AMRP(**knobs), {}
    for r in stream:
        R = amrp(r)
        R_ref, state = rr.amrp_step(state, r, **knobs)
        torch.testing.assert_close(R, R_ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(amrp.weights, state["w"], rtol=1e-9, atol=1e-12)
        w = amrp.weights
        assert abs(float(w.sum()) - 1) < 1e-9 and bool((w >= 0.02 - 1e-12).all())


@settings(max_examples=20)
@given(reward_streams(K=1), st.integers(2, 4))
def test_identical_dimensions_give_uniform_weights(stream, K):
    amrp = AMRP()
    for r in stream:
        amrp(r.repeat(1, K))
        torch.testing.assert_close(amrp.weights, torch.full((K,), 1.0 / K, dtype=torch.float64))


@settings(max_examples=20)
@given(reward_streams())
def test_eta_zero_freezes_the_initial_weights(stream):
    K = stream[0].shape[1]
    w0 = torch.linspace(1, 2, K, dtype=torch.float64)
    w0 = (w0 / w0.sum()).tolist()
    amrp = AMRP(eta=0.0, initial_weights=w0)
    for r in stream:
        amrp(r)
        assert amrp.weights.tolist() == w0


def test_saturated_dimension_falls_to_the_floor():
    amrp = AMRP(r_min=[0.0, 0.0], r_max=[1.0, 1.0])
    for _ in range(100):
        amrp(torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64))  # dim 0 at r_max, dim 1 at r_min
    assert abs(float(amrp.weights[0]) - 0.02) < 1e-9  # softmax share 1/(1+e^4) < w_min: held at the floor
    amrp = AMRP(r_min=[0.0, 0.0], r_max=[1.0, 1.0])
    for _ in range(100):
        amrp(torch.tensor([[1.0, 0.0], [1.0, 0.1]], dtype=torch.float64))  # dim 1 slightly less lagging
    assert float(amrp.weights[0]) < 0.025  # → its softmax share 1/(1+e^3.8) ≈ 0.022, near the floor


@settings(max_examples=20)
@given(reward_streams(), st.randoms(use_true_random=False))
def test_permutation_equivariant_in_k(stream, rnd):
    K = stream[0].shape[1]
    perm = list(range(K))
    rnd.shuffle(perm)
    a, b = AMRP(), AMRP()
    for r in stream:
        Ra, Rb = a(r), b(r[:, perm])
        torch.testing.assert_close(Ra, Rb, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(a.weights[perm], b.weights, rtol=1e-9, atol=1e-12)


def test_no_gradient_through_the_weights():
    r = torch.rand(4, 3, dtype=torch.float64, requires_grad=True)
    out = AMRP()(r)
    assert not out.requires_grad and not AMRP().state


@settings(max_examples=10)
@given(reward_streams())
def test_two_data_parallel_ranks_equal_one(stream):
    stream = [r for r in stream if r.shape[0] >= 2]
    single = AMRP()
    ref = [single(r) for r in stream]
    dp = [AMRP(), AMRP()]

    def rank(rk, g):
        outs = []
        for r in stream:
            half = r.shape[0] // 2
            outs.append(dp[rk](r[:half] if rk == 0 else r[half:], g))
        return outs

    outs = SimulatedWorld(2).run(rank)
    for t, R in enumerate(ref):
        torch.testing.assert_close(torch.cat([outs[0][t], outs[1][t]]), R, rtol=1e-9, atol=1e-9)
    if stream:
        torch.testing.assert_close(dp[0].weights, single.weights)
        torch.testing.assert_close(dp[1].weights, single.weights)


def test_checkpoint_round_trip_continues_identically():
    g = torch.Generator().manual_seed(0)
    stream = [torch.rand(5, 3, generator=g, dtype=torch.float64) for _ in range(6)]
    a = AMRP()
    for r in stream[:3]:
        a(r)
    b = AMRP()
    b.load_state_dict(a.state_dict())
    for r in stream[3:]:
        assert torch.equal(a(r), b(r))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"rewards must be \[B, K\]"):
        AMRP()(torch.zeros(3))
    with pytest.raises(ValueError, match="initial_weights"):
        AMRP(initial_weights=[0.99, 0.01])(torch.zeros(2, 2))


def test_example_loads():
    amrp = build_reward_shaping(load_example("amrp")["reward"])
    assert isinstance(amrp, AMRP) and (amrp.tau, amrp.eta, amrp.w_min) == (0.5, 0.1, 0.02)
