"""SoftmaxGRPO: packed estimator equals reference/credit.py; the method's invariants."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.credit as rc
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.methods.credit.softmax_grpo import softmax_grpo
from tests.methods.helpers import assert_objective_equivalent, example_objective, load_example
from tests.property.strategies import rl_cases
from tests.property.test_advantages import reward_batches

TEMPS = st.sampled_from([0.05, 0.3, 1.0, 10.0])


@settings(max_examples=25)
@given(reward_batches(), TEMPS)
def test_matches_reference(b, tau):
    torch.testing.assert_close(
        softmax_grpo(b.rewards, b.group_ids, tau),
        rc.softmax_grpo(b.rewards, b.group_ids, tau),
        rtol=1e-10,
        atol=1e-10,
    )


@settings(max_examples=25)
@given(reward_batches(), TEMPS, st.floats(-5, 5))
def test_sum_zero_bounds_weights_mean_one_and_shift_invariance(b, tau, shift):
    adv = softmax_grpo(b.rewards, b.group_ids, tau)
    for g in torch.unique(b.group_ids):
        a = adv[b.group_ids == g]
        G = a.numel()
        assert abs(float(a.sum())) < 1e-9  # weights w = (A+1)/G have mean 1/G, i.e. G·w has mean one
        assert float(a.min()) >= -1 - 1e-12 and float(a.max()) <= G - 1 + 1e-9
    torch.testing.assert_close(softmax_grpo(b.rewards + shift, b.group_ids, tau), adv, rtol=1e-8, atol=1e-8)


def test_saturated_groups_get_exactly_zero():
    gids = torch.tensor([0, 0, 0, 1, 1, 1])
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    assert torch.equal(softmax_grpo(r, gids, 0.3), torch.zeros(6, dtype=torch.float64))


def test_low_temperature_is_maxrl_and_high_temperature_is_mean_centred():
    r = torch.tensor([1, 1, 0, 0, 0, 0], dtype=torch.float64)
    gids = torch.zeros(6, dtype=torch.long)
    # MaxRL: G/k − 1 on the k successes, −1 on failures (spec: [2, 2, −1, −1, −1, −1])
    torch.testing.assert_close(
        softmax_grpo(r, gids, 1e-3), torch.tensor([2.0, 2, -1, -1, -1, -1], dtype=torch.float64)
    )
    tau = 1e5
    torch.testing.assert_close(tau * softmax_grpo(r, gids, tau), r - r.mean(), rtol=1e-4, atol=1e-4)
    rg = torch.randn(6, dtype=torch.float64)
    torch.testing.assert_close(tau * softmax_grpo(rg, gids, tau), rg - rg.mean(), rtol=1e-4, atol=1e-4)


def test_bounded_where_grpo_diverges():
    G = 16
    r = torch.ones(G, dtype=torch.float64)
    r[0] = 0.0  # near-solved prompt: one failure
    adv = softmax_grpo(r, torch.zeros(G, dtype=torch.long), 0.3)
    assert float(adv[0]) >= -1.0
    from megarl.advantages.estimators import grpo

    assert float(grpo(r, torch.zeros(G, dtype=torch.long))[0]) < -3.5  # −sqrt(G−1) for GRPO


def test_rejects_non_positive_temperature():
    import pytest

    with pytest.raises(ValueError, match="temperature"):
        softmax_grpo(torch.zeros(2), torch.zeros(2, dtype=torch.long), 0.0)


@settings(max_examples=8)
@given(rl_cases(cfgs=st.just(example_objective("softmax-grpo"))), st.sampled_from([1, 2]))
def test_example_objective_on_softmax_advantages_tp1_tp2(case, tp):
    b = case.batch
    b.rewards = b.rewards.double()
    b.advantages = ADVANTAGE_ESTIMATORS.get("softmax_grpo")(b, temperature=0.3).to(b.loss_mask.dtype)
    assert_objective_equivalent(case, tp)


def test_example_loads():
    cfg = load_example("softmax-grpo")
    assert cfg["advantage"]["estimator"] == "softmax_grpo"
