"""TACO: the ``taco`` policy loss equals the reference (loss and logits gradient, TP=1 and TP=2);
the invariants of the authors' code (xiuyilou/TACO)."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.credit as rc
from megarl.methods.credit.taco import taco_advantages, taco_weights
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective
from megarl.testing.equivalence import Case, reference_loss_and_grad
from reference.logprobs import entropy, token_logprobs
from tests.methods.helpers import assert_objective_equivalent, example_objective, load_example
from tests.property.strategies import rl_cases

BASES = st.sampled_from(["ppo", "gspo", "cispo", "dppo_tv"])


def taco_reference(alpha: float, lam: float):
    """Reference: TACO advantages from the full logits (detached), then the base loss."""

    def run(case: Case):
        logp = token_logprobs(case.logits.double(), case.batch.tokens)
        ent = entropy(case.logits.double())
        adv = rc.taco_advantages(case.batch.advantages.double(), logp, ent, alpha, lam)
        b = dataclasses.replace(case.batch, advantages=adv.to(case.batch.loss_mask.dtype))
        base = dataclasses.replace(
            case.cfg, policy_loss=case.cfg.policy_loss_args["base"], policy_loss_args={}
        )
        return reference_loss_and_grad(Case(b, case.logits, base, case.teacher_logits, case.extra))

    return run


@settings(max_examples=15)
@given(
    rl_cases(),
    BASES,
    st.sampled_from([0.01, 0.3]),
    st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    st.sampled_from([1, 2]),
)
def test_loss_and_grad_match_reference_tp1_tp2(case, base, alpha, lam, tp):
    case.cfg = dataclasses.replace(
        case.cfg, policy_loss="taco", policy_loss_args={"base": base, "alpha": alpha, "lam": lam}
    )
    assert_objective_equivalent(case, tp, reference=taco_reference(alpha, lam))


@settings(max_examples=25)
@given(
    st.lists(st.floats(-30, 0), min_size=1, max_size=20),
    st.floats(0, 8),
    st.sampled_from([1e-3, 0.01, 0.5]),
    st.floats(0, 1),
)
def test_weights_bounded_one_on_safe_tokens_and_monotone(logps, H, alpha, lam):
    lp = torch.tensor(sorted(logps, reverse=True), dtype=torch.float64)  # increasing surprisal
    h = torch.full_like(lp, H)
    w = taco_weights(lp, h, alpha, lam)
    torch.testing.assert_close(w, rc.taco_weights(lp, h, alpha, lam), rtol=1e-12, atol=1e-12)
    assert bool(((w >= 1 - lam - 1e-12) & (w <= 1)).all())
    safe = lp >= -h + math.log(alpha)
    assert bool((w[safe] == 1).all())
    assert bool((w[1:] <= w[:-1] + 1e-12).all())  # non-increasing in surprisal at fixed H


def test_negative_and_zero_advantages_untouched_and_lambda_zero_is_identity():
    lp = torch.tensor([-20.0, -20.0, -20.0, -0.1], dtype=torch.float64)
    h = torch.tensor([0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    adv = torch.tensor([-1.5, 0.0, 2.0, 2.0], dtype=torch.float64)
    out = taco_advantages(adv, lp, h, 0.01, 0.9)
    assert out[0] == -1.5 and out[1] == 0.0 and out[3] == 2.0 and 0.2 <= float(out[2]) < 2.0
    assert torch.equal(taco_advantages(adv, lp, h, 0.01, 0.0), adv)


@settings(max_examples=15)
@given(rl_cases(cfgs=st.just(ObjectiveConfig())))
def test_lambda_zero_is_exactly_the_base_loss_and_no_gradient_through_w(case):
    from megarl.objectives.api import GlobalNormalisers, LossContext

    ctx = LossContext(GlobalNormalisers.from_batch(case.batch))
    logits = case.logits.clone().requires_grad_(True)
    base = build_objective({})(logits, case.batch, ctx).loss
    taco0 = build_objective({"policy_loss": "taco", "policy_loss_args": {"lam": 0.0}})(
        logits, case.batch, ctx
    ).loss
    assert torch.equal(base, taco0)
    # with λ > 0 the gradient is that of the base loss on the detached shaped advantages
    obj = build_objective({"policy_loss": "taco", "policy_loss_args": {"lam": 0.9}})
    (g1,) = torch.autograd.grad(obj(logits, case.batch, ctx).loss, logits)
    logp = token_logprobs(case.logits, case.batch.tokens)
    shaped = taco_advantages(case.batch.advantages, logp, entropy(case.logits), 0.01, 0.9)
    b2 = dataclasses.replace(case.batch, advantages=shaped)
    (g2,) = torch.autograd.grad(build_objective({})(logits, b2, ctx).loss, logits)
    torch.testing.assert_close(g1, g2, rtol=1e-9, atol=1e-12)


def test_validation_matches_the_authors_checks():
    with pytest.raises(ValueError, match="alpha"):
        taco_weights(torch.zeros(1), torch.zeros(1), alpha=0.0)
    with pytest.raises(ValueError, match="lam"):
        taco_weights(torch.zeros(1), torch.zeros(1), lam=1.5)


@settings(max_examples=6)
@given(rl_cases(cfgs=st.just(example_objective("taco"))), st.sampled_from([1, 2]))
def test_example_config_matches_reference(case, tp):
    args = case.cfg.policy_loss_args
    assert_objective_equivalent(case, tp, reference=taco_reference(args["alpha"], args["lam"]))


def test_example_loads_with_authors_defaults():
    cfg = load_example("taco")
    assert cfg["objective"]["policy_loss_args"] == {"base": "ppo", "alpha": 0.01, "lam": 0.9}
    assert (cfg["objective"]["clip_low"], cfg["objective"]["clip_high"]) == (0.2, 0.28)
