"""TRIAL: the ``trial`` regulariser with PPO equals reference/agents.py (loss and gradient at TP 1/2,
DP 1/2, micro-batches) and the spec's invariants (multipliers' eligible-token mean 1, equal turn
magnitudes give m = 1, a zero gap gives no distillation gradient, observation tokens get none)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.agents as ra
from megarl.batch import unpack
from megarl.methods.agents.trial import trial, trial_multipliers
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective
from reference.policy_losses import ppo_clip
from tests.methods.helpers import load_example
from tests.methods.test_taspo import LAYOUTS, _batch, assistant_turns
from tests.methods.trust_regions_harness import (
    aggregate,
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    reference_method_loss_and_grad,
)
from tests.methods.turn_cases import padded, privileged_padded, turn_cases
from tests.property.strategies import rl_cases

AGGS = ("token-mean", "seq-mean-token-mean", "token-sum", "seq-mean-token-sum")
CFGS = st.builds(
    ObjectiveConfig,
    policy_loss=st.just("ppo"),
    clip_low=st.just(0.2),
    clip_high=st.sampled_from([0.2, 0.28]),
    aggregation=st.sampled_from(AGGS),
    regularisers=st.sampled_from([0.5, 1.0]).map(lambda c: [{"name": "trial", "coef": c}]),
)


@settings(max_examples=3, deadline=None)
@given(turn_cases(rl_cases(torch.float64, cfgs=CFGS)))
def test_loss_and_gradient_match_reference(tc):
    case, turns = tc
    b = case.batch
    b.token_extras["hindsight_logprobs"] = case.extra["privileged"]
    b.extras["hindsight_on"] = case.extra["on"]
    cfg = case.cfg

    def fn(full, pad):
        logp, old, adv, mask = padded_inputs(full, pad)
        pg = ppo_clip(logp, old, adv, cfg.clip_low, cfg.clip_high)
        hd = ra.trial_hd_per_token(logp, privileged_padded(case), old, mask, turns)
        coef = cfg.regularisers[0]["coef"]
        return aggregate(pg, pad, cfg.aggregation) + coef * aggregate(hd, pad, cfg.aggregation)

    want = reference_method_loss_and_grad(case, fn)
    for tp, dp, mb in LAYOUTS:
        assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, min(mb, b.num_seqs)), want, case.logits)


def _trial_batch(seed, scale=1.0):
    b = _batch(torch.Generator().manual_seed(seed), scale)
    b.token_extras["hindsight_logprobs"] = b.token_extras.pop("pi_logprobs")
    b.extras["hindsight_on"] = b.extras.pop("pi_on")
    return b


def _grad(b, logits):
    """d(Σ_t L_HD,t)/d logits of the regulariser alone."""
    logits = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(logits, -1).gather(-1, b.tokens[:, None])[:, 0]
    trial(logits, logp, b.old_logprobs, b, None).sum().backward()
    return logits.grad


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0.1, 1.0, 5.0]))
def test_multipliers_have_eligible_token_mean_one(seed, scale):
    b = _trial_batch(seed, scale)
    gap = b.token_extras["hindsight_logprobs"] - b.old_logprobs
    m, turn = trial_multipliers(gap, b)
    seq = b.seq_index()
    on = turn >= 0
    n = torch.zeros_like(m)
    n.index_put_((seq[on], turn[on]), torch.ones(int(on.sum()), dtype=torch.float64), accumulate=True)
    mean = (m * n).sum(1) / n.sum(1)
    torch.testing.assert_close(mean, torch.ones_like(mean), rtol=0, atol=1e-12)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0.05, 1.0, 5.0]))
def test_term_matches_reference_on_multi_turn_batches(seed, scale):
    b = _trial_batch(seed, scale)
    b.extras["hindsight_on"][0] = 0.0  # one sequence read without a hindsight context
    logp = -torch.rand(b.num_tokens, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    pad = unpack(b)
    on = b.extras["hindsight_on"].bool()[b.seq_index()]
    hind = padded(b, torch.where(on, b.token_extras["hindsight_logprobs"], b.old_logprobs))
    want = ra.trial_hd_per_token(
        padded(b, logp), hind, pad.per_token["old_logprobs"], pad.loss_mask, assistant_turns(b)
    )
    torch.testing.assert_close(
        padded(b, trial(None, logp, b.old_logprobs, b, None)), want, rtol=1e-9, atol=1e-12
    )


def test_equal_turn_magnitudes_give_unit_multipliers_and_zero_gap_no_gradient():
    b = _trial_batch(1)
    sign = torch.where(torch.rand(b.num_tokens, generator=torch.Generator().manual_seed(2)) < 0.5, -1.0, 1.0)
    gap = 0.7 * sign.double()  # |δ| equal everywhere: M_k equal
    m, _ = trial_multipliers(gap, b)
    torch.testing.assert_close(m, torch.ones_like(m), rtol=0, atol=1e-12)  # M_k equal up to rounding
    logits = torch.randn(b.num_tokens, 5, dtype=torch.float64)
    b.tokens = b.tokens % 5
    b.token_extras["hindsight_logprobs"] = b.old_logprobs.clone()  # δ ≡ 0
    assert torch.equal(_grad(b, logits), torch.zeros_like(logits))
    b.token_extras["hindsight_logprobs"] = b.old_logprobs + 1.0
    b.extras["hindsight_on"][:] = 0.0  # no hindsight context read: δ ≡ 0
    assert torch.equal(_grad(b, logits), torch.zeros_like(logits))


def test_observation_tokens_get_no_gradient():
    b = _trial_batch(4, 2.0)
    b.tokens = b.tokens % 5
    logits = torch.randn(b.num_tokens, 5, dtype=torch.float64)
    g = _grad(b, logits)
    off = b.loss_mask == 0  # prompt and observation tokens
    assert torch.equal(g[off], torch.zeros_like(g[off]))
    assert bool(g[~off].abs().sum(-1).gt(0).all())  # every model token is pushed


def test_positive_gap_raises_the_token_probability():
    b = _trial_batch(5)
    b.tokens = b.tokens % 5
    b.token_extras["hindsight_logprobs"] = b.old_logprobs + torch.linspace(
        0.1, 1.0, b.num_tokens, dtype=torch.float64
    )
    logits = torch.zeros(b.num_tokens, 5, dtype=torch.float64)
    g = _grad(b, logits)
    on = b.loss_mask.bool()
    own = g.gather(-1, b.tokens[:, None])[:, 0]
    assert bool((own[on] < 0).all())  # gradient descent raises the sampled token's logit


def test_objective_reports_the_term_and_missing_inputs_are_named():
    b = _trial_batch(0)
    b.tokens = b.tokens % 5
    b.advantages = torch.zeros(b.num_tokens, dtype=torch.float64)
    obj = build_objective(ObjectiveConfig(policy_loss="ppo", regularisers=[{"name": "trial", "coef": 0.5}]))
    out = obj(
        torch.randn(b.num_tokens, 5, dtype=torch.float64),
        b,
        LossContext(GlobalNormalisers.from_batch(b, None, 0.0)),
    )
    assert "reg/trial" in out.metrics
    del b.token_extras["hindsight_logprobs"]
    with pytest.raises(ValueError, match="hindsight_logprobs"):
        obj(
            torch.randn(b.num_tokens, 5, dtype=torch.float64),
            b,
            LossContext(GlobalNormalisers.from_batch(b, None, 0.0)),
        )


def test_example_loads():
    cfg = load_example("trial")
    assert cfg["objective"]["regularisers"][0]["name"] == "trial" and cfg["method"]["name"] == "trial"
