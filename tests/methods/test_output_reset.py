"""Output Reset (PPO-OR / GRPO-OR): megarl equals reference/trust_regions.py:output_reset (loss and
gradient, TP 1/2, DP 1/2, micro-batches), and the method's invariants."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.batch import from_sequences
from megarl.methods.trust_regions.output_reset import output_reset as or_loss
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.policy_losses import ppo
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective
from reference import trust_regions as ref
from tests.methods.trust_regions_harness import (
    aggregate,
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases

AGGS = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum"]
CFGS = st.builds(
    ObjectiveConfig,
    policy_loss=st.just("output_reset"),
    aggregation=st.sampled_from(AGGS),
    policy_loss_args=st.fixed_dictionaries(
        {"margin": st.sampled_from([math.log(1.2), 0.05, 0.5]), "adv_power": st.sampled_from([0.0, 1.0])}
    ),
)
M = math.log(1.2)


def _reference(case):
    knobs, mode = case.cfg.policy_loss_args, case.cfg.aggregation

    def fn(full, pad):
        logp, old, adv, _ = padded_inputs(full, pad)
        return aggregate(ref.output_reset(logp, old, adv, **knobs), pad, mode)

    return reference_method_loss_and_grad(case, fn)


@settings(max_examples=12)
@given(
    case=rl_cases(torch.float64, cfgs=CFGS),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_matches_reference(case, tp, dp, mb):
    assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, mb), _reference(case), case.logits)


def _grad(lr: torch.Tensor, adv: torch.Tensor, fn=or_loss, **kw) -> torch.Tensor:
    lr = lr.clone().requires_grad_(True)
    fn(lr, torch.zeros_like(lr), adv, None, None, **kw).sum().backward()
    return lr.grad


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_past_the_margin_loss_and_gradient_are_zero(p):
    adv = torch.tensor([2.0, -0.5, 1.0, -3.0], dtype=torch.float64)
    lr = torch.tensor([M, -M, M + 0.3, -M - 2.0], dtype=torch.float64)
    assert torch.all(or_loss(lr, torch.zeros_like(lr), adv, None, None, adv_power=p) == 0)
    assert torch.all(_grad(lr, adv, adv_power=p) == 0)


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_gradient_at_ratio_one_is_parallel_to_ppo(p):
    adv = torch.tensor([2.0, -0.5, 1.5, -3.0], dtype=torch.float64)
    g = _grad(torch.zeros(4, dtype=torch.float64), adv, adv_power=p)
    torch.testing.assert_close(g, -(adv.abs() ** p) * M * torch.sign(adv))
    g_ppo = _grad(torch.zeros(4, dtype=torch.float64), adv, fn=ppo)  # = -A at r = 1
    assert torch.all(torch.sign(g) == torch.sign(g_ppo))


@given(a=st.floats(0.1, 5.0) | st.floats(-5.0, -0.1), p=st.sampled_from([0.0, 1.0]))
def test_derivative_is_continuous_at_the_margin_and_ppo_is_not(a, p):
    """One-sided finite differences at the margin agree (C¹); PPO-clip's jump there."""
    adv = torch.tensor([a], dtype=torch.float64)
    edge = math.copysign(M, a)
    h = 1e-6

    def d(fn, x0, x1, **kw):
        f = lambda x: fn(  # noqa: E731
            torch.tensor([x], dtype=torch.float64), torch.zeros(1, dtype=torch.float64), adv, None, None, **kw
        ).item()
        return (f(x1) - f(x0)) / (x1 - x0)

    left, right = d(or_loss, edge - h, edge, adv_power=p), d(or_loss, edge, edge + h, adv_power=p)
    assert abs(left - right) < 1e-5 * max(1.0, abs(a))
    ppo_edge = math.log(1.28) if a > 0 else math.log(0.8)
    pl, pr = d(ppo, ppo_edge - h, ppo_edge), d(ppo, ppo_edge, ppo_edge + h)
    assert abs(pl - pr) > 0.5 * abs(a)


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_zero_advantage_gives_zero_loss(p):
    lr = torch.tensor([-1.0, 0.0, 0.4], dtype=torch.float64)
    adv = torch.zeros(3, dtype=torch.float64)
    assert torch.all(or_loss(lr, torch.zeros_like(lr), adv, None, None, adv_power=p) == 0)
    assert torch.all(_grad(lr, adv, adv_power=p) == 0)


@given(a=st.floats(-4, 4), x=st.floats(-2, 2), h=st.floats(1e-3, 0.5), p=st.sampled_from([0.0, 1.0]))
def test_convex_in_the_log_ratio(a, x, h, p):
    xs = torch.tensor([x - h, x, x + h], dtype=torch.float64)
    f = or_loss(
        xs,
        torch.zeros(3, dtype=torch.float64),
        torch.full((3,), a, dtype=torch.float64),
        None,
        None,
        adv_power=p,
    )
    assert f[0] + f[2] - 2 * f[1] >= -1e-12


def test_bad_margin_is_named():
    with pytest.raises(ValueError, match="policy_loss_args.margin"):
        or_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), None, None, margin=0.0)


def test_diagnostics_are_reported():
    b = from_sequences([[1], [2]], [[3, 4], [5]], [0, 0])
    b.advantages = torch.tensor([0.0, 1.0, 1.0, 0.0, -1.0], dtype=torch.float64)
    logits = torch.randn(5, 7, dtype=torch.float64)
    lp = torch.log_softmax(logits, -1)[torch.arange(5), b.tokens]
    b.old_logprobs = lp.detach() - torch.tensor(
        [0.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64
    )  # 2nd token past m
    out = build_objective({"policy_loss": "output_reset"})(logits, b, LossContext(GlobalNormalisers(3, 2, 2)))
    torch.testing.assert_close(
        out.metrics["output_reset/overshoot_frac"], torch.tensor(1 / 3, dtype=torch.float64)
    )
    torch.testing.assert_close(
        out.metrics["output_reset/residual"], torch.tensor(2 * M / 3, dtype=torch.float64)
    )
    torch.testing.assert_close(
        out.metrics["output_reset/log_ratio_abs"], torch.tensor(1 / 3, dtype=torch.float64)
    )
