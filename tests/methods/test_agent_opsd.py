"""AgentOPSD: the estimator equals reference/agents.py (advantages; PPO loss and gradient at TP 1/2,
DP 1/2, micro-batches) and the spec's invariants (teacher = student is GRPO, telescoping belief
revisions, positive mean-one weights, the sign of A kept)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.agents as ra
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import grpo
from megarl.batch import unpack
from megarl.methods.agents.agent_opsd import agent_opsd_weights, beliefs
from tests.methods.helpers import load_example
from tests.methods.teacher_advantages_harness import ppo_cfgs
from tests.methods.test_taspo import LAYOUTS, _batch, assistant_turns
from tests.methods.trust_regions_harness import assert_equivalent, megarl_method_loss_and_grad
from tests.methods.turn_cases import padded, ppo_reference, privileged_padded, turn_cases
from tests.property.strategies import rl_cases

EST = ADVANTAGE_ESTIMATORS.get("agent_opsd")
KNOBS = st.fixed_dictionaries(
    {
        "lam": st.sampled_from([0.5, 0.9]),
        "rho": st.sampled_from([1.0, 0.7]),
        "beta": st.sampled_from([1.0, 0.3]),
        "w_hi": st.sampled_from([2.0, 1.2]),
    }
)


def with_teacher(b, priv, on, correct):
    """The self-teacher's inputs on a batch."""
    b.self_teacher_logprobs = priv
    b.extras["self_teacher_on"] = on
    b.extras["self_teacher_correct"] = correct
    return b


def ref_adv(case, knobs):
    def fn(pad):
        b = case.batch
        return ra.agent_opsd_advantages(
            b.rewards, b.group_ids, b.extras["self_teacher_correct"], privileged_padded(case),
            pad.per_token["old_logprobs"], pad.loss_mask, case.extra["turns"], **knobs,
        )  # fmt: skip

    return fn


@settings(max_examples=3, deadline=None)
@given(turn_cases(rl_cases(torch.float64, cfgs=ppo_cfgs())), KNOBS)
def test_loss_and_gradient_match_reference(tc, knobs):
    case, turns = tc
    case = dataclasses.replace(case, extra=dict(case.extra, turns=turns))
    b = case.batch
    correct = (torch.rand(b.num_seqs, generator=case.extra["rng"]) < 0.5).double()
    with_teacher(b, case.extra["privileged"], case.extra["on"], correct)
    got_adv = EST(b, **knobs)
    torch.testing.assert_close(padded(b, got_adv), ref_adv(case, knobs)(unpack(b)), rtol=1e-9, atol=1e-9)
    b.advantages = got_adv.to(case.logits.dtype)
    want = ppo_reference(case, ref_adv(case, knobs))
    for tp, dp, mb in LAYOUTS:
        assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, min(mb, b.num_seqs)), want, case.logits)


def _opsd_batch(seed, scale=1.0):
    b = _batch(torch.Generator().manual_seed(seed), scale)
    g = torch.Generator().manual_seed(seed + 1)
    correct = (torch.rand(b.num_seqs, generator=g) < 0.5).double()
    return with_teacher(b, b.token_extras.pop("pi_logprobs"), b.extras.pop("pi_on"), correct)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 2**31 - 1), KNOBS, st.sampled_from([0.05, 0.5, 3.0]))
def test_advantages_match_reference_on_multi_turn_batches(seed, knobs, scale):
    b = _opsd_batch(seed, scale)
    b.extras["self_teacher_on"][0] = 0.0  # one sequence the self-teacher did not read
    pad = unpack(b)
    on = b.extras["self_teacher_on"].bool()[b.seq_index()]
    t = padded(b, torch.where(on, b.self_teacher_logprobs, b.old_logprobs))
    want = ra.agent_opsd_advantages(
        b.rewards, b.group_ids, b.extras["self_teacher_correct"], t, pad.per_token["old_logprobs"],
        pad.loss_mask, assistant_turns(b), **knobs,
    )  # fmt: skip
    torch.testing.assert_close(padded(b, EST(b, **knobs)), want, rtol=1e-9, atol=1e-9)


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31 - 1), KNOBS, st.sampled_from([0.1, 1.0, 5.0]))
def test_weights_positive_mean_one_sign_kept(seed, knobs, scale):
    b = _opsd_batch(seed, scale)
    adv, w, turn, _ = agent_opsd_weights(b, **knobs)
    n = torch.zeros_like(w)
    seq = b.seq_index()
    on = turn >= 0
    n.index_put_((seq[on], turn[on]), torch.ones(int(on.sum()), dtype=torch.float64), accumulate=True)
    mean = (w * n).sum(1) / n.sum(1)
    torch.testing.assert_close(mean, torch.ones_like(mean), rtol=0, atol=1e-9)
    assert bool((w[n > 0] > 0).all())
    tok = EST(b, **knobs)
    m = b.loss_mask.bool()
    assert torch.equal(torch.sign(tok[m]), torch.sign(adv[seq][m]))


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_teacher_equal_to_student_is_grpo(seed):
    b = _opsd_batch(seed)
    base = grpo(b.rewards.double(), b.group_ids)[b.seq_index()] * b.loss_mask.double()
    b.self_teacher_logprobs = b.old_logprobs.clone()
    assert torch.equal(EST(b), base)
    b = _opsd_batch(seed)
    b.extras["self_teacher_on"][:] = 0.0  # nothing read with a privileged context
    assert torch.equal(EST(b), base)


@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.floats(-20, 20), min_size=1, max_size=6),
    st.floats(0, 1),
    st.sampled_from([1.0, 0.5]),
    st.sampled_from([1.0, 0.2]),
)
def test_belief_update_is_additive_and_revisions_telescope(e, prior, rho, beta):
    ev = torch.tensor([e], dtype=torch.float64)
    b = beliefs(ev, torch.tensor([prior]), rho, beta, 0.05)[0]
    torch.testing.assert_close(
        b, torch.tensor(ra.agent_opsd_beliefs(e, prior, rho, beta), dtype=torch.float64)
    )
    rev = b[1:] - b[:-1]
    torch.testing.assert_close(rev.sum(), b[-1] - b[0], rtol=0, atol=1e-12)
    if rho == 1.0:  # log-odds add up: L_K = L_0 + β Σ e_k
        L = torch.logit(b[-1].clamp(1e-12, 1 - 1e-12))
        p = min(max(prior, 0.05), 0.95)
        want = torch.tensor(p / (1 - p)).log() + beta * sum(e)
        if abs(float(want)) < 20:  # away from σ saturating in float64
            torch.testing.assert_close(L, want.double(), rtol=1e-6, atol=1e-6)


def test_bad_knobs_and_missing_inputs_are_named():
    b = _opsd_batch(0)
    with pytest.raises(ValueError, match="prior_eps"):
        EST(b, prior_eps=0.0)
    with pytest.raises(ValueError, match="lam"):
        EST(b, lam=-0.1)
    b.self_teacher_logprobs = None
    with pytest.raises(ValueError, match="self_teacher_logprobs"):
        EST(b)


def test_example_loads():
    cfg = load_example("agent-opsd")
    assert cfg["advantage"]["estimator"] == "agent_opsd" and cfg["method"]["name"] == "agent_opsd"
