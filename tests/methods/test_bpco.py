"""BPCO: megarl's length-adaptive GAE and Monte Carlo value targets equal reference/critics.py
``lagae``; the whole objective (DPPO-TV/KL on those advantages, the value loss of bounded values
toward those targets) equals the reference in loss and gradient under TP, DP and micro-batch splits;
and the recipe's invariants (long responses give the Monte Carlo advantage R − V, the targets are
the outcome reward whatever α and V, short responses get λ = 0, the critic's warm-up holds the
policy for exactly its steps)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.critics as rc
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import length_adaptive_lam, monte_carlo_returns
from megarl.batch import from_sequences, unpack
from megarl.methods.critics.critic import Critic, CriticKnobs, value_targets
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.objectives.value_losses import ValueObjective
from megarl.plugin.knobs import build_knobs
from megarl.testing.equivalence import megarl_loss_and_grad, reference_loss_and_grad
from megarl.trainer.method_runtime import AdvantageStage, MethodRuntime
from tests.property.strategies import rl_cases
from tests.property.test_advantages import reward_batches

ALPHAS = st.sampled_from([0.1, 0.4, 1.0, 1e9])
GAE = ADVANTAGE_ESTIMATORS.get("gae")


def _padded(b, x):
    """[T] packed -> [B, L] padded like ``unpack`` (0 outside each sequence)."""
    am = unpack(b).attention_mask
    out = torch.zeros(am.shape, dtype=torch.float64)
    out[am] = x.double()
    return out


def _reference(b, gamma, alpha):
    """reference lagae on the padded batch -> (advantages [T], returns [T])."""
    pad = unpack(b)
    am = pad.attention_mask
    r = (
        _padded(b, b.token_rewards)
        if b.token_rewards is not None
        else torch.zeros(am.shape, dtype=torch.float64)
    )
    if b.token_rewards is None:  # the outcome reward on each sequence's last loss token
        for i in range(r.shape[0]):
            idx = pad.loss_mask[i].nonzero().flatten()
            if idx.numel():
                r[i, idx[-1]] = float(b.rewards[i])
    adv, ret = rc.lagae(r, _padded(b, b.values), pad.loss_mask.double(), gamma, alpha)
    return adv[am], ret[am]


@settings(max_examples=60)
@given(reward_batches(), ALPHAS, st.sampled_from([1.0, 0.9]), st.booleans())
def test_lagae_and_monte_carlo_targets_match_reference(b, alpha, gamma, outcome_only):
    if outcome_only:
        b.token_rewards = None
    adv = GAE(b, gamma=gamma, lam_alpha=alpha)
    ret = value_targets(b, "monte_carlo", gamma)
    want_adv, want_ret = _reference(b, gamma, alpha)
    torch.testing.assert_close(adv, want_adv, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ret.double(), want_ret, rtol=1e-10, atol=1e-10)
    assert value_targets(b, "estimator") is b.returns  # the estimator's own returns (GAE with λ_i)


def _objective_cases():
    cfgs = st.builds(
        ObjectiveConfig,
        policy_loss=st.sampled_from(["dppo_tv", "dppo_kl"]),
        aggregation=st.just("seq-mean-token-sum"),
        clip_low=st.just(0.2),
        clip_high=st.just(0.28),
    )
    return rl_cases(torch.float64, cfgs=cfgs, min_groups=2)


@settings(max_examples=25, deadline=None)
@given(
    _objective_cases(), ALPHAS, st.integers(0, 2**31 - 1), st.sampled_from([(1, 1, 1), (2, 2, 2), (1, 2, 3)])
)
def test_bpco_objective_matches_reference_loss_and_gradient(case, alpha, seed, split):
    """Policy side: DPPO on BPCO's advantages; critic side: the value loss of bounded values toward
    the Monte Carlo targets. Both in loss and gradient (logits; the value head's raw outputs)."""
    b = case.batch
    g = torch.Generator().manual_seed(seed)
    b.token_rewards = None
    b.values = torch.rand(b.num_tokens, generator=g, dtype=torch.float64)  # V_old, inside [0, 1]
    adv = GAE(b, gamma=1.0, lam_alpha=alpha)
    b.returns = value_targets(b, "monte_carlo", 1.0)
    want_adv, want_ret = _reference(b, 1.0, alpha)
    b.advantages = adv * b.loss_mask
    tp, dp, mb = split
    loss, grad = megarl_loss_and_grad(case, tp=tp, dp=dp, micro_batches=mb)
    ref_case = dataclasses.replace(case, batch=dataclasses.replace(b, advantages=want_adv * b.loss_mask))
    ref_loss, ref_grad = reference_loss_and_grad(ref_case)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-10)

    raw = torch.randn(b.num_tokens, generator=g, dtype=torch.float64)
    low, high = 0.0, 1.0
    r1 = raw.clone().requires_grad_(True)
    v = rc.bounded_values(r1, low, high)
    ctx = LossContext(normalisers=GlobalNormalisers.from_batch(b))
    got = ValueObjective("clipped", 0.2)(v[:, None], b, ctx).loss
    got.backward()
    r2 = raw.clone().requires_grad_(True)
    pad_m = unpack(b).loss_mask
    want = rc.value_loss(
        _bounded_padded(b, r2, low, high),
        _padded(b, b.values),
        _padded(b, want_ret),
        pad_m,
        "clipped",
        0.2,
    )
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(r1.grad, r2.grad, rtol=1e-10, atol=1e-12)


def _bounded_padded(b, raw, low, high):
    """Bounded values of ``raw`` [T] laid out [B, L] (differentiable in ``raw``)."""
    am = unpack(b).attention_mask
    out = torch.zeros(am.shape, dtype=raw.dtype)
    return out.masked_scatter(am, rc.bounded_values(raw, low, high))


def _one_response(length: int, reward: float, values: list[float]):
    b = from_sequences([[1, 2]], [list(range(3, 3 + length))], [0])
    b.rewards = torch.tensor([reward], dtype=torch.float64)
    v = torch.zeros(b.num_tokens, dtype=torch.float64)
    v[2:] = torch.tensor(values, dtype=torch.float64)
    b.values = v
    return b


def test_long_responses_give_the_monte_carlo_advantage():
    """λ → 1 as α·L → ∞: Â_t = R − V_t (γ = 1), the critic-baselined outcome."""
    L = 50
    vals = torch.linspace(0.1, 0.9, L).tolist()
    b = _one_response(L, 1.0, vals)
    adv = GAE(b, gamma=1.0, lam_alpha=1e12)[2:]
    torch.testing.assert_close(adv, 1.0 - torch.tensor(vals, dtype=torch.float64), rtol=0, atol=1e-9)
    lam = length_adaptive_lam(torch.tensor([10, 100, 1000, 10000]), 0.4)
    assert bool((lam[1:] > lam[:-1]).all()) and float(lam[-1]) > 0.999


@given(st.integers(1, 12), st.floats(0.01, 10.0), st.floats(-2.0, 2.0), st.integers(0, 2**31 - 1))
def test_monte_carlo_targets_are_the_outcome_reward_whatever_alpha_and_values(L, alpha, reward, seed):
    g = torch.Generator().manual_seed(seed)
    b = _one_response(L, reward, torch.randn(L, generator=g).tolist())
    GAE(b, gamma=1.0, lam_alpha=alpha)
    ret = value_targets(b, "monte_carlo", 1.0)
    torch.testing.assert_close(ret[2:], torch.full((L,), reward, dtype=torch.float64), rtol=0, atol=1e-12)
    assert bool((ret[:2] == 0).all())
    torch.testing.assert_close(ret, monte_carlo_returns(b, 1.0))


def test_short_responses_get_lambda_zero_not_a_negative_one():
    """α = 0.4: L = 2 gives 1 − 1/0.8 = −0.25 unclamped; megarl clamps to 0 (one-step TD)."""
    lam = length_adaptive_lam(torch.tensor([0, 1, 2, 3, 5]), 0.4)
    torch.testing.assert_close(lam, torch.tensor([0.0, 0.0, 0.0, 1 - 1 / 1.2, 0.5], dtype=torch.float64))
    b = _one_response(2, 1.0, [0.3, 0.6])
    adv = GAE(b, gamma=1.0, lam_alpha=0.4)[2:]
    # λ = 0: Â_t = δ_t = r_t + V_{t+1} − V_t
    torch.testing.assert_close(adv, torch.tensor([0.6 - 0.3, 1.0 - 0.6], dtype=torch.float64))
    assert rc.length_adaptive_lam(2, 0.4) == 0.0 and rc.length_adaptive_lam(3, 0.4) == pytest.approx(
        1 - 1 / 1.2
    )


def test_bad_alpha_and_critic_knobs_name_the_key():
    b = _one_response(3, 1.0, [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="advantage.lam_alpha"):
        GAE(b, lam_alpha=0.0)
    with pytest.raises(ValueError, match="inputs.values: targets"):
        build_knobs(CriticKnobs, {"targets": "td"}, "inputs.values")
    with pytest.raises(ValueError, match="inputs.values: warmup_steps"):
        build_knobs(CriticKnobs, {"warmup_steps": -1}, "inputs.values")


def test_warmup_holds_the_policy_for_exactly_n_steps():
    """The critic's gate through the run's method runtime: steps 1..N skip the policy update."""
    critic = object.__new__(Critic)  # the gate reads only the knobs (no learner needed)
    critic.knobs = build_knobs(CriticKnobs, {"warmup_steps": 3}, "inputs.values")

    class Cfg:
        class advantage:
            estimator, knobs = "gae", {}

    rt = MethodRuntime(inputs={}, advantages=AdvantageStage(Cfg), step_hooks=[critic])
    assert [rt.updates_policy(s) for s in range(1, 6)] == [False, False, False, True, True]
    critic.knobs = build_knobs(CriticKnobs, {}, "inputs.values")
    assert rt.updates_policy(1)
