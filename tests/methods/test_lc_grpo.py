"""LC-GRPO on the tiny flow model: transitions, per-step log-probs, the loss and its gradient equal
reference/flow.py (per-sample loops), micro-batch / data-parallel splits add up to the whole
batch; η = 0 is the Euler ODE; the log-prob is torch.distributions.Normal's; the velocity-derived
score and the Langevin correction on the Gaussian toy (exact velocity known)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.flow as rf
from megarl.methods.gradients import flow_model as fm
from megarl.methods.gradients.lc_grpo import LCGRPOHook, LCGRPOKnobs, group_advantages, step_loss
from tests.methods.helpers import EXAMPLES, assert_splits_add_up, velocity_model

_model = velocity_model


def _one(model):
    return lambda x, t: model(x[None], t)[0]


CASES = st.tuples(
    st.integers(0, 2**16), st.sampled_from(["lc", "flow_grpo"]), st.sampled_from([0.1, 0.7]), st.booleans()
)


@settings(max_examples=6, deadline=None)
@given(CASES, st.sampled_from([3, 4]), st.sampled_from([(1, 1), (2, 1), (3, 2)]))
def test_loss_and_gradient_equal_the_reference_and_splits_add_up(case, steps, split):
    seed, sampler, a, exact = case
    model = _model(seed)
    gen = torch.Generator().manual_seed(seed)
    G, groups = 3, 2
    noise = torch.randn(G * groups, 2, generator=gen, dtype=torch.float64)
    traj, old, idx = fm.sample(model, noise, steps, sampler, a, gen, exact)
    rewards = fm.gaussian_logprob(traj[-1], torch.zeros(2, dtype=torch.float64), 1.0)
    adv = group_advantages(rewards, G)
    torch.testing.assert_close(adv, torch.tensor(rf.group_advantages(rewards.tolist(), G), dtype=adv.dtype))
    old = old + 0.05 * torch.randn(old.shape, generator=gen, dtype=old.dtype)  # an off-policy update
    # megarl, whole batch
    new = fm.step_logprobs(model, traj, idx, steps, sampler, a, exact)
    loss, _ = step_loss(new, old, adv, 0.2)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    # reference: per sample, per step
    times = fm.time_grid(steps)
    ref_new = [
        rf.sde_step_logprobs(_one(model), list(traj[:, i]), times, a, sampler, exact)
        for i in range(G * groups)
    ]
    ref_loss = rf.grpo_step_loss(ref_new, old.T.tolist(), adv.tolist(), 0.2)
    torch.testing.assert_close(new.T, torch.stack([torch.stack(r) for r in ref_new]), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    for g, r in zip(grads, torch.autograd.grad(ref_loss, list(model.parameters()))):
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-12)
    # dp replicas x micro-batches over samples, each normalised by the whole batch's term count
    dp, micro = split

    def part_loss(part):
        nl = fm.step_logprobs(model, traj[:, part], idx, steps, sampler, a, exact)
        return step_loss(nl, old[:, part], adv[part], 0.2, count=new.numel())[0]

    splits = torch.arange(G * groups).tensor_split(dp * micro)
    assert_splits_add_up(loss, grads, model.parameters(), (part_loss(p) for p in splits))


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from(["lc", "flow_grpo"]), st.integers(2, 6))
def test_zero_randomness_is_exactly_the_euler_ode(seed, sampler, steps):
    model = _model(seed)
    noise = torch.randn(4, 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    traj, lp, idx = fm.sample(model, noise, steps, sampler, 0.0, torch.Generator())
    x, times = noise, fm.time_grid(steps)
    with torch.no_grad():
        for k in range(steps):
            x = x - (times[k] - times[k + 1]) * model(x, times[k])
    assert torch.equal(traj[-1], x) and lp.numel() == 0 and idx == []


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**16), st.floats(1e-3, 2.0))
def test_logprob_is_the_normal_log_density(seed, var):
    g = torch.Generator().manual_seed(seed)
    x, mean = (
        torch.randn(5, 2, generator=g, dtype=torch.float64),
        torch.randn(5, 2, generator=g, dtype=torch.float64),
    )
    want = torch.distributions.Normal(mean, math.sqrt(var)).log_prob(x).sum(-1)
    torch.testing.assert_close(fm.gaussian_logprob(x, mean, var), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rf.gaussian_logprob(x[0], mean[0], var), want[0], rtol=1e-12, atol=1e-12)


def _gaussian_toy(m: float, s: float):
    """p_0 = N(m, s²): p_t = N((1 − t) m, (1 − t)² s² + t²) and its exact velocity and score."""

    def stats(t):
        return (1 - t) * m, (1 - t) ** 2 * s * s + t * t

    def velocity(x, t: float):  # E[ε − x_0 | x_t = x]
        mu, var = stats(t)
        return (t - (1 - t) * s * s) / var * (x - mu) - m

    return stats, velocity


@settings(max_examples=30, deadline=None)
@given(st.floats(-3, 3), st.floats(0.05, 2), st.floats(0.05, 1.0), st.floats(-4, 4))
def test_score_from_velocity_is_exact_on_the_gaussian_toy(m, s, t, x):
    stats, velocity = _gaussian_toy(m, s)
    mu, var = stats(t)
    xt = torch.tensor([[x]], dtype=torch.float64)
    got = fm.score(xt, t, velocity(xt, t))
    torch.testing.assert_close(got, -(xt - mu) / var, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(rf.score_from_velocity(xt, t, velocity(xt, t)), got, rtol=0, atol=0)


def _w2_after(stats, velocity, t, s_time, sampler_a):
    """W2² between p_s and the law of one step from x ~ p_t (the step is affine in x here)."""
    zero, one = torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    b, var = fm.transition(velocity, zero, t, s_time, "lc", sampler_a)
    A = float(fm.transition(velocity, one, t, s_time, "lc", sampler_a)[0] - b)
    mu_t, var_t = stats(t)
    mu_s, var_s = stats(s_time)
    mean, sd = A * mu_t + float(b), math.sqrt(A * A * var_t + var)
    return (mean - mu_s) ** 2 + (sd - math.sqrt(var_s)) ** 2


@settings(max_examples=30, deadline=None)
@given(st.floats(-3, 3), st.floats(0.5, 2), st.integers(4, 50), st.floats(0.01, 0.3), st.data())
def test_langevin_correction_does_not_increase_w2_on_the_gaussian_toy(m, s, K, a, data):
    """Holds for data spread s >= 0.5 and randomness a <= 0.3 (see docs/methods/lc-grpo.md: with a
    sharply peaked p_0 and fine steps one Langevin step can add its O(η²/σ_s²) bias)."""
    k = data.draw(st.integers(0, K - 2))
    stats, velocity = _gaussian_toy(m, s)
    t, s_time = 1 - k / K, 1 - (k + 1) / K
    euler = _w2_after(stats, velocity, t, s_time, 0.0)
    corrected = _w2_after(stats, velocity, t, s_time, a)
    assert corrected <= euler + 1e-12, (euler, corrected)


def test_one_step_trains_the_flow_model_and_its_state_round_trips():
    k = LCGRPOKnobs(pretrain_steps=0, hidden=8, steps=3, groups=2, group_size=3, updates=1)
    hook = LCGRPOHook(k)
    assert hook.updates_policy(1) is False  # the language-model policy is held still
    m = hook.after_step(1, {})
    assert m["lc_grpo/update_norm"] > 0 and m["lc_grpo/stochastic_steps"] == 2.0, m
    other = LCGRPOHook(k)
    other.load_state_dict(copy.deepcopy(hook.state_dict()))  # as a checkpoint's torch.save/load
    assert all(torch.equal(p, q) for p, q in zip(hook.model.parameters(), other.model.parameters()))
    assert other.after_step(2, {}) == hook.after_step(2, {})  # same state, same step: same result


def test_knobs_are_checked_and_the_example_loads():
    with pytest.raises(ValueError, match="method.sampler"):
        LCGRPOKnobs(sampler="ddim").check()
    with pytest.raises(ValueError, match="method.group_size"):
        LCGRPOKnobs(group_size=1).check()
    cfg = yaml.safe_load((EXAMPLES / "lc-grpo.yaml").read_text())
    assert cfg["method"]["name"] == "lc-grpo" and cfg["base"] == "../quickstart.yaml"
    fields = set(LCGRPOKnobs.__dataclass_fields__)
    assert set(cfg["method"]) - {"name"} <= fields


def test_flow_model_choice_and_dit_shapes_are_checked():
    from types import SimpleNamespace

    from megarl.learner.flow_dit import FlowDiTSpec
    from megarl.learner.parallel import ParallelLayout
    from megarl.methods.gradients.flow_megatron import dit_spec

    with pytest.raises(ValueError, match="method.model"):
        LCGRPOKnobs(model="dit").check()
    with pytest.raises(ValueError, match="heads=3"):
        FlowDiTSpec(hidden=24, heads=3).check(tp=2)
    with pytest.raises(ValueError, match="needs tp=1"):
        FlowDiTSpec(experts=4).check(tp=2, ep=2)
    with pytest.raises(ValueError, match="experts=3 must be divisible by ep=2"):
        FlowDiTSpec(experts=3).check(ep=2)

    def groups(**lay):
        return SimpleNamespace(layout=ParallelLayout(**lay))

    k = LCGRPOKnobs(model="megatron", hidden=16, heads=2)  # experts: -1 follows the layout's ep
    assert dit_spec(k, groups()).experts == 0 and dit_spec(k, groups(ep=2)).experts == 4
    assert dit_spec(LCGRPOKnobs(model="megatron", experts=6), groups(ep=2)).experts == 6
    with pytest.raises(ValueError, match="method \\(flow model\\): experts=3"):
        dit_spec(LCGRPOKnobs(model="megatron", experts=3), groups(ep=2))
