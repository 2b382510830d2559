"""Bypass mode (REINFORCE on the rollout log-probs): megarl equals reference/peers.py (loss and
gradient: TP 1/2, DP 1/2, micro-batches, packed vs padded) and the method's invariants."""

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.peers as rp
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.testing.equivalence import megarl_loss_and_grad
from tests.methods.trust_regions_harness import (
    aggregate,
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases


@st.composite
def bypass_cfgs(draw, levels=("none", "token", "sequence")):
    args = {"is_level": draw(st.sampled_from(levels)), "is_threshold": draw(st.sampled_from([1.0, 1.2, 2.0]))}
    return ObjectiveConfig(
        policy_loss="bypass_reinforce",
        aggregation=draw(st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])),
        policy_loss_args=args,
    )


def _reference(case):
    args = case.cfg.policy_loss_args

    def fn(full, pad):
        logp, _, adv, mask = padded_inputs(full, pad)
        roll = pad.per_token["rollout_logprobs"]
        return aggregate(rp.bypass_reinforce(logp, roll, adv, mask, **args), pad, case.cfg.aggregation)

    return reference_method_loss_and_grad(case, fn)


@settings(max_examples=15)
@given(
    case=rl_cases(torch.float64, cfgs=bypass_cfgs()),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_matches_reference(case, tp, dp, mb):
    assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, mb), _reference(case), case.logits)


def _current(case):
    return torch.log_softmax(case.logits, -1).gather(-1, case.batch.tokens[:, None])[:, 0]


@settings(max_examples=10)
@given(case=rl_cases(torch.float64, cfgs=bypass_cfgs(levels=("none",))))
def test_without_is_weights_it_is_gpg(case):
    got = megarl_loss_and_grad(case, tp=2, micro_batches=2)
    gpg = dataclasses.replace(case.cfg, policy_loss="gpg", policy_loss_args={})
    want = megarl_loss_and_grad(dataclasses.replace(case, cfg=gpg), tp=2, micro_batches=2)
    assert_equivalent(got, want, case.logits, rtol=1e-12, atol=1e-14)


@settings(max_examples=10)
@given(case=rl_cases(torch.float64, cfgs=bypass_cfgs(levels=("token", "sequence"))))
def test_on_the_rollout_policy_the_gradient_is_ppos_on_rollout_logprobs(case):
    """π_θ = π_rollout: every IS weight is 1 (below any threshold ≥ 1) and the gradient is −A∇logp,
    PPO's at ratio 1 against the rollout log-probs; the recomputed old log-probs play no part."""
    b = case.batch
    cur = _current(case)
    case = dataclasses.replace(
        case, batch=dataclasses.replace(b, rollout_logprobs=cur, old_logprobs=cur - 0.5)
    )
    _, g = megarl_loss_and_grad(case, tp=2, micro_batches=2)
    ppo = dataclasses.replace(case.cfg, policy_loss="ppo", policy_loss_args={})
    on_roll = dataclasses.replace(case.batch, old_logprobs=cur)
    _, g_ppo = megarl_loss_and_grad(dataclasses.replace(case, cfg=ppo, batch=on_roll), tp=2, micro_batches=2)
    torch.testing.assert_close(g, g_ppo, rtol=1e-9, atol=1e-12)


@settings(max_examples=20)
@given(case=rl_cases(torch.float64, cfgs=bypass_cfgs(levels=("token", "sequence"))))
def test_weights_are_truncated_at_the_threshold(case):
    from megarl.methods.peers.bypass import is_weights

    b, args = case.batch, case.cfg.policy_loss_args
    w = is_weights(_current(case), b.rollout_logprobs, b.loss_mask, b.cu_seqlens, **args)
    assert float(w.max()) <= args["is_threshold"] and float(w.min()) >= 0
    big = is_weights(_current(case), b.rollout_logprobs, b.loss_mask, b.cu_seqlens, args["is_level"], 1e9)
    torch.testing.assert_close(w, big.clamp(max=args["is_threshold"]))


# ------------------------------------------------------------------------------------------ DRO


@st.composite
def dro_cfgs(draw):
    return ObjectiveConfig(
        policy_loss="dro",
        aggregation=draw(st.sampled_from(["token-mean", "seq-mean-token-mean", "token-sum"])),
        policy_loss_args={"beta": draw(st.sampled_from([0.0, 0.05, 1.0]))},
    )


def _dro_reference(case):
    def fn(full, pad):
        logp, _, adv, _ = padded_inputs(full, pad)
        loss = rp.dro(logp, pad.per_token["rollout_logprobs"], adv, **case.cfg.policy_loss_args)
        return aggregate(loss, pad, case.cfg.aggregation)

    return reference_method_loss_and_grad(case, fn)


@settings(max_examples=15)
@given(
    case=rl_cases(torch.float64, cfgs=dro_cfgs()),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_dro_matches_reference(case, tp, dp, mb):
    assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, mb), _dro_reference(case), case.logits)


@settings(max_examples=10)
@given(case=rl_cases(torch.float64, cfgs=dro_cfgs()))
def test_dro_is_reinforce_plus_beta_times_the_k2_penalty_to_the_rollout(case):
    """β = 0 is plain REINFORCE (GPG's loss); the penalty is k2 against the rollout log-probs: its
    gradient is β(logp − roll)∇logp, zero on the rollout policy."""
    beta = case.cfg.policy_loss_args["beta"]
    got = megarl_loss_and_grad(case, tp=2, micro_batches=2)
    gpg = dataclasses.replace(case.cfg, policy_loss="gpg", policy_loss_args={})
    b = case.batch
    as_ref = dataclasses.replace(b, ref_logprobs=b.rollout_logprobs)
    with_k2 = dataclasses.replace(gpg, kl_coef=beta, kl_estimator="k2") if beta else gpg
    want = megarl_loss_and_grad(dataclasses.replace(case, cfg=with_k2, batch=as_ref), tp=2, micro_batches=2)
    assert_equivalent(got, want, case.logits, rtol=1e-10, atol=1e-12)
