"""The peers' KL parts: the estimators ``abs`` and ``k1_k2grad`` in the composed objective equal
reference/peers.py (loss and gradient: TP 1/2, DP 1/2, micro-batches, packed vs padded), and the
``kl_reward`` advantage estimator (KL in the reward, fixed or adaptive coefficient) equals the
reference on any base estimator; invariants of both."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.advantages as ra
import reference.peers as rp
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.batch import unpack
from megarl.methods.peers.kl_reward import KLController, _make_controller
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.testing.equivalence import megarl_loss_and_grad
from reference.policy_losses import ppo_clip
from tests.methods.trust_regions_harness import (
    aggregate,
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases
from tests.property.test_advantages import reward_batches

REF_KL = {"abs": rp.kl_abs, "k1_k2grad": rp.kl_k1_value_k2_grad}


@st.composite
def kl_cfgs(draw, estimators=("abs", "k1_k2grad")):
    return ObjectiveConfig(
        policy_loss="ppo",
        kl_coef=draw(st.sampled_from([0.1, 1.0])),
        kl_estimator=draw(st.sampled_from(estimators)),
        aggregation=draw(st.sampled_from(["token-mean", "seq-mean-token-mean", "token-sum"])),
    )


def _reference(case):
    cfg = case.cfg

    def fn(full, pad):
        logp, old, adv, _ = padded_inputs(full, pad)
        pg = aggregate(ppo_clip(logp, old, adv, 0.2, 0.28), pad, cfg.aggregation)
        kl = REF_KL[cfg.kl_estimator](logp, pad.per_token["ref_logprobs"])
        return pg + cfg.kl_coef * aggregate(kl, pad, cfg.aggregation)

    return reference_method_loss_and_grad(case, fn)


@settings(max_examples=15)
@given(
    case=rl_cases(torch.float64, cfgs=kl_cfgs()),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_kl_estimators_match_reference(case, tp, dp, mb):
    assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, mb), _reference(case), case.logits)


def _with(case, est):
    return dataclasses.replace(case, cfg=dataclasses.replace(case.cfg, kl_estimator=est))


@settings(max_examples=10)
@given(case=rl_cases(torch.float64, cfgs=kl_cfgs(estimators=("k1_k2grad",))))
def test_k1_value_with_k2_gradient(case):
    loss, grad = megarl_loss_and_grad(case, tp=2, micro_batches=2)
    loss_k1, _ = megarl_loss_and_grad(_with(case, "k1"), tp=2, micro_batches=2)
    _, grad_k2 = megarl_loss_and_grad(_with(case, "k2"), tp=2, micro_batches=2)
    torch.testing.assert_close(loss, loss_k1, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(grad, grad_k2, rtol=1e-12, atol=1e-13)


@given(
    x=st.lists(st.floats(-5, 5), min_size=1, max_size=8), y=st.lists(st.floats(-5, 5), min_size=8, max_size=8)
)
def test_abs_is_the_magnitude_of_k1(x, y):
    lp, ref = torch.tensor(x, dtype=torch.float64), torch.tensor(y[: len(x)], dtype=torch.float64)
    from megarl.objectives.kl import KL_ESTIMATORS

    got = KL_ESTIMATORS.get("abs")(lp, ref)
    assert torch.all(got >= 0)
    torch.testing.assert_close(got, KL_ESTIMATORS.get("k1")(lp, ref).abs())


# ---------------------------------------------------------------------------------- kl_reward

BASES = {
    "grpo": lambda r, b: ra.grpo(r, b.group_ids),
    "dr_grpo": lambda r, b: ra.dr_grpo(r, b.group_ids),
    "rloo": lambda r, b: ra.rloo(r, b.group_ids),
    "opo": lambda r, b: rp.opo_advantages(r, b.group_ids, b.response_lens()),
}


def _with_logprobs(b, seed):
    g = torch.Generator().manual_seed(seed)
    b.old_logprobs = -torch.rand(b.num_tokens, generator=g, dtype=torch.float64) * 2
    b.ref_logprobs = -torch.rand(b.num_tokens, generator=g, dtype=torch.float64) * 2
    return b


@settings(max_examples=30)
@given(
    b=reward_batches(),
    seed=st.integers(0, 2**31 - 1),
    base=st.sampled_from(sorted(BASES)),
    ctrl=st.sampled_from(["fixed", "adaptive"]),
    est=st.sampled_from(["k1", "abs", "k3"]),
    steps=st.integers(1, 3),
)
def test_kl_reward_matches_reference(b, seed, base, ctrl, est, steps):
    b = _with_logprobs(b, seed)
    knobs = {
        "base": base,
        "kl_coef": 0.05,
        "kl_estimator": est,
        "controller": ctrl,
        "target_kl": 0.3,
        "horizon": 20.0,
    }
    state = _make_controller(**knobs)
    pad = unpack(b)
    tok = pad.per_token
    kl_fn = {"k1": lambda a, r: a - r, "abs": rp.kl_abs, "k3": lambda a, r: torch.exp(r - a) - (r - a) - 1}[
        est
    ]
    ref_ctrl = rp.AdaptiveKLController(0.05, 0.3, 20.0) if ctrl == "adaptive" else rp.FixedKLController(0.05)
    for _ in range(steps):  # the coefficient moves between steps
        adv = ADVANTAGE_ESTIMATORS.get("kl_reward")(b, state=state, **knobs)
        shaped, _ = rp.kl_in_reward(
            b.rewards, tok["old_logprobs"], tok["ref_logprobs"], pad.loss_mask, ref_ctrl, kl_fn
        )
        want = BASES[base](shaped, b)[b.seq_index()] * b.loss_mask.double()
        torch.testing.assert_close(adv, want, rtol=1e-10, atol=1e-10)
        assert state.value == pytest.approx(ref_ctrl.value, rel=1e-12)


@settings(max_examples=20)
@given(b=reward_batches(), seed=st.integers(0, 2**31 - 1), base=st.sampled_from(sorted(BASES)))
def test_kl_reward_with_zero_coefficient_is_the_base_estimator(b, seed, base):
    b = _with_logprobs(b, seed)
    got = ADVANTAGE_ESTIMATORS.get("kl_reward")(b, base=base, kl_coef=0.0)
    assert torch.equal(got, ADVANTAGE_ESTIMATORS.get(base)(b))


def test_adaptive_controller_moves_toward_the_target_and_is_checkpointed():
    c = KLController(0.1, "adaptive", target_kl=0.2, horizon=100.0)
    c.update(0.2, 50)  # on target: unchanged
    assert c.value == 0.1
    c.update(1.0, 50)  # far above: +20 % * 50/100
    assert c.value == pytest.approx(0.1 * 1.1)
    c.update(0.0, 50)  # far below: -20 % * 50/100
    assert c.value == pytest.approx(0.1 * 1.1 * 0.9)
    again = KLController(0.1, "adaptive", target_kl=0.2, horizon=100.0)
    again.load_state_dict(c.state_dict())
    assert again.value == c.value and again.metrics() == c.metrics()
    f = KLController(0.1, "fixed")
    f.update(5.0, 1000)
    assert f.value == 0.1


def test_kl_reward_refuses_what_it_cannot_wrap():
    with pytest.raises(ValueError, match="allowed: fixed, adaptive"):
        _make_controller(controller="pid")
    from megarl.batch import from_sequences

    b = from_sequences([[1], [1]], [[2, 3], [4]], [0, 0])
    b.rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    b = _with_logprobs(b, 0)
    for base, msg in (("kl_reward", "another estimator"), ("gepo", "keeps state")):
        with pytest.raises(ValueError, match=msg):
            ADVANTAGE_ESTIMATORS.get("kl_reward")(b, base=base)
