"""GPG: the estimator and the policy loss equal reference/peers.py (loss and gradient: TP 1/2,
DP 1/2, micro-batches, packed vs padded) and the method's invariants."""

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.peers as rp
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import dr_grpo
from megarl.methods.peers.gpg import gpg_advantages
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
from tests.property.test_advantages import reward_batches

AGGS = st.sampled_from(["token-mean", "seq-mean-token-mean", "token-sum", "seq-mean-token-sum"])


def on_policy(case):
    """The case with old log-probs equal to the current policy's (every ratio exactly 1)."""
    logp = torch.log_softmax(case.logits, -1).gather(-1, case.batch.tokens[:, None])[:, 0]
    return dataclasses.replace(case, batch=dataclasses.replace(case.batch, old_logprobs=logp.clone()))


@settings(max_examples=30)
@given(reward_batches(), st.sampled_from([1.0, 0.5, 3.0]))
def test_advantages_match_reference(b, f_norm):
    torch.testing.assert_close(
        gpg_advantages(b.rewards, b.group_ids, f_norm),
        rp.gpg_advantages(b.rewards, b.group_ids, f_norm),
        rtol=1e-12,
        atol=1e-12,
    )
    tok = ADVANTAGE_ESTIMATORS.get("gpg")(b, f_norm=f_norm)
    want = gpg_advantages(b.rewards, b.group_ids, f_norm)[b.seq_index()] * b.loss_mask.double()
    torch.testing.assert_close(tok, want, rtol=0, atol=0)


@settings(max_examples=30)
@given(reward_batches())
def test_groups_sum_to_zero_and_all_nonzero_rewards_give_dr_grpo(b):
    adv = gpg_advantages(b.rewards, b.group_ids)
    for g in torch.unique(b.group_ids):
        idx = b.group_ids == g
        if idx.sum() > 1:
            assert abs(float(adv[idx].sum())) < 1e-9
    shifted = b.rewards + 10.0  # every reward non-zero: α = 1, the baseline is the group mean
    multi = torch.stack([(b.group_ids == g).sum() > 1 for g in b.group_ids])
    torch.testing.assert_close(
        gpg_advantages(shifted, b.group_ids)[multi],
        dr_grpo(shifted, b.group_ids)[multi],
        rtol=1e-12,
        atol=1e-12,
    )


def test_alpha_rescales_by_the_share_of_nonzero_rewards():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    gid = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # α = 8 / 2 = 4; group mean 0.25
    want = 4 * (r - 0.25)
    torch.testing.assert_close(gpg_advantages(r, gid), want)
    assert torch.equal(
        gpg_advantages(torch.zeros(4, dtype=torch.float64), gid[:4]), torch.zeros(4, dtype=torch.float64)
    )


@st.composite
def gpg_cfgs(draw):
    return ObjectiveConfig(policy_loss="gpg", aggregation=draw(AGGS))


def _reference(case):
    def fn(full, pad):
        logp, _, adv, _ = padded_inputs(full, pad)
        return aggregate(rp.gpg_loss(logp, adv), pad, case.cfg.aggregation)

    return reference_method_loss_and_grad(case, fn)


@settings(max_examples=12)
@given(
    case=rl_cases(torch.float64, cfgs=gpg_cfgs()),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_matches_reference(case, tp, dp, mb):
    assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, mb), _reference(case), case.logits)


@settings(max_examples=10)
@given(case=rl_cases(torch.float64, cfgs=gpg_cfgs()))
def test_on_policy_gradient_is_ppos(case):
    """At ratio 1 the PPO surrogate's gradient is −A ∇logp, GPG's everywhere."""
    case = on_policy(case)
    _, g = megarl_loss_and_grad(case, tp=2, micro_batches=2)
    ppo = dataclasses.replace(case, cfg=dataclasses.replace(case.cfg, policy_loss="ppo"))
    _, g_ppo = megarl_loss_and_grad(ppo, tp=2, micro_batches=2)
    torch.testing.assert_close(g, g_ppo, rtol=1e-9, atol=1e-12)


@settings(max_examples=10)
@given(case=rl_cases(torch.float64, cfgs=gpg_cfgs()))
def test_old_logprobs_do_not_matter(case):
    shifted = dataclasses.replace(
        case, batch=dataclasses.replace(case.batch, old_logprobs=case.batch.old_logprobs - 0.7)
    )
    got, want = megarl_loss_and_grad(shifted, tp=1), megarl_loss_and_grad(case, tp=1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
