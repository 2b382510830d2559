"""TASPO: the estimator equals reference/agents.py (advantages; PPO loss and gradient at TP 1/2,
DP 1/2, 1-3 micro-batches) and the spec's invariants (mean-one bounded positive weights, the
trajectory's sign kept, constant PI shift = GRPO, A = 0 gives no gradient, invariance to a
constant added to the PI logprobs)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.agents as ra
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import grpo
from megarl.batch import from_sequences, unpack
from megarl.methods.agents.taspo import taspo_weights
from megarl.methods.agents.turns import mean_preserving_weights
from tests.methods.helpers import load_example
from tests.methods.teacher_advantages_harness import ppo_cfgs
from tests.methods.trust_regions_harness import assert_equivalent, megarl_method_loss_and_grad
from tests.methods.turn_cases import padded, ppo_reference, privileged_padded, turn_cases
from tests.property.strategies import rl_cases

EST = ADVANTAGE_ESTIMATORS.get("taspo")
KNOBS = st.fixed_dictionaries(
    {
        "lam": st.sampled_from([0.5, 0.9]),
        "w_lo": st.sampled_from([0.25, 0.8]),
        "w_hi": st.sampled_from([2.0, 1.2]),
        "scale_by_std": st.booleans(),
    }
)


def with_pi(case):
    """The case's batch with its privileged logprobs as the PI bank's input."""
    b = case.batch
    b.token_extras["pi_logprobs"] = case.extra["privileged"]
    b.extras["pi_on"] = case.extra["on"]
    return b


def ref_adv(case, knobs):
    def fn(pad):
        b = case.batch
        return ra.taspo_advantages(
            b.rewards, b.group_ids, privileged_padded(case), pad.per_token["old_logprobs"],
            pad.loss_mask, case.extra["turns"], **knobs,
        )  # fmt: skip

    return fn


LAYOUTS = ((1, 1, 1), (2, 2, 3))  # (TP, DP, micro-batches): unsharded, and every split at once


@settings(max_examples=3, deadline=None)
@given(turn_cases(rl_cases(torch.float64, cfgs=ppo_cfgs())), KNOBS)
def test_loss_and_gradient_match_reference(tc, knobs):
    case, turns = tc
    case = dataclasses.replace(case, extra=dict(case.extra, turns=turns))
    b = with_pi(case)
    got_adv = EST(b, **knobs)
    torch.testing.assert_close(padded(b, got_adv), ref_adv(case, knobs)(unpack(b)), rtol=1e-9, atol=1e-9)
    b.advantages = got_adv.to(case.logits.dtype)
    want = ppo_reference(case, ref_adv(case, knobs))
    for tp, dp, mb in LAYOUTS:
        assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, min(mb, b.num_seqs)), want, case.logits)


def _batch(rng, shift_scale=1.0):
    """A multi-turn batch of two groups with PI logprobs (observations masked out)."""
    B = 6
    prompts = [[1, 2]] * B
    responses, spans = [], []
    for _ in range(B):
        toks, sp, pos = [], [(0, 2, "prompt")], 2
        for _k in range(int(torch.randint(1, 5, (1,), generator=rng))):
            a = int(torch.randint(1, 4, (1,), generator=rng))
            toks += [3] * a
            sp.append((pos, pos + a, "assistant"))
            pos += a
            toks += [4]
            sp.append((pos, pos + 1, "observation"))
            pos += 1
        responses.append(toks)
        spans.append(sp)
    b = from_sequences(
        prompts, responses, [0, 0, 0, 1, 1, 1], rewards=torch.rand(B, generator=rng), turn_spans=spans
    )
    for i, sp in enumerate(b.turn_spans):
        for s, e, r in sp:
            if r == "observation":
                b.loss_mask[int(b.cu_seqlens[i]) + s : int(b.cu_seqlens[i]) + e] = 0
    b.old_logprobs = -torch.rand(b.num_tokens, generator=rng, dtype=torch.float64) * 3
    b.token_extras["pi_logprobs"] = b.old_logprobs + shift_scale * torch.randn(
        b.num_tokens, generator=rng, dtype=torch.float64
    )
    b.extras["pi_on"] = torch.ones(B, dtype=torch.float64)
    return b


def assistant_turns(b):
    """Per sequence, its assistant (start, end) spans: the reference's view of the turns."""
    return [[(s, e) for s, e, r in sp if r == "assistant"] for sp in b.turn_spans]


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 2**31 - 1), KNOBS, st.sampled_from([0.1, 1.0, 10.0]))
def test_advantages_match_reference_on_multi_turn_batches(seed, knobs, scale):
    b = _batch(torch.Generator().manual_seed(seed), scale)
    b.extras["pi_on"][0] = 0.0  # one sequence without PI
    pad = unpack(b)
    pi = padded(
        b, torch.where(b.extras["pi_on"].bool()[b.seq_index()], b.token_extras["pi_logprobs"], b.old_logprobs)
    )
    want = ra.taspo_advantages(
        b.rewards, b.group_ids, pi, pad.per_token["old_logprobs"], pad.loss_mask, assistant_turns(b), **knobs
    )
    torch.testing.assert_close(padded(b, EST(b, **knobs)), want, rtol=1e-9, atol=1e-9)


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31 - 1), KNOBS, st.sampled_from([0.1, 1.0, 10.0]))
def test_weights_are_positive_bounded_mean_one_and_keep_the_sign(seed, knobs, scale):
    b = _batch(torch.Generator().manual_seed(seed), scale)
    adv, w, _, n = taspo_weights(b, **knobs)
    valid = n > 0
    mean = (w * n).sum(1) / n.sum(1)
    torch.testing.assert_close(mean, torch.ones_like(mean), rtol=0, atol=1e-9)
    assert bool((w[valid] >= knobs["w_lo"] - 1e-12).all() and (w[valid] <= knobs["w_hi"] + 1e-12).all())
    assert bool((w[valid] > 0).all())
    tok = EST(b, **knobs)
    m = b.loss_mask.bool()
    assert torch.equal(torch.sign(tok[m]), torch.sign(adv[b.seq_index()][m]))


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(-5, 5))
def test_constant_shift_is_grpo_and_shift_invariant(seed, c):
    b = _batch(torch.Generator().manual_seed(seed))
    base = grpo(b.rewards.double(), b.group_ids)[b.seq_index()] * b.loss_mask.double()
    pi = b.token_extras["pi_logprobs"].clone()
    got = EST(b)
    b.token_extras["pi_logprobs"] = pi + c
    torch.testing.assert_close(EST(b), got, rtol=1e-7, atol=1e-9)  # a constant added to every ℓ^PI
    b.token_extras["pi_logprobs"] = b.old_logprobs + c  # the same shift on every action: GRPO
    torch.testing.assert_close(EST(b), base, rtol=1e-8, atol=1e-8)  # Δ_k equal up to rounding
    b.token_extras["pi_logprobs"] = pi
    b.extras["pi_on"][:] = 0.0  # no verified success in the bank yet: GRPO
    assert torch.equal(EST(b), base)


def test_equal_rewards_give_zero_advantages_and_no_gradient():
    from megarl.objectives.api import GlobalNormalisers, LossContext
    from megarl.objectives.rl_objective import ObjectiveConfig, build_objective

    b = _batch(torch.Generator().manual_seed(3))
    b.rewards = torch.ones(b.num_seqs)
    b.advantages = EST(b).float()
    assert torch.equal(b.advantages, torch.zeros_like(b.advantages))
    logits = torch.randn(b.num_tokens, 8, requires_grad=True)
    b.tokens = b.tokens % 8
    out = build_objective(ObjectiveConfig(policy_loss="ppo"))(
        logits, b, LossContext(GlobalNormalisers.from_batch(b, None, 0.0))
    )
    out.loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits.grad))


@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.floats(0.05, 3.0), min_size=1, max_size=6),
    st.lists(st.integers(1, 5), min_size=6, max_size=6),
    st.sampled_from([(0.25, 2.0), (0.9, 1.1), (0.0, 1.0), (1.0, 4.0)]),
)
def test_mean_preserving_weights_equal_the_bisection_reference(w_hat, n, bounds):
    lo, hi = bounds
    n = [float(x) for x in n[: len(w_hat)]]
    got = mean_preserving_weights(
        torch.tensor([w_hat + [1.0]], dtype=torch.float64), torch.tensor([n + [0.0]]), lo, hi
    )
    want = ra.mean_one_weights(w_hat, n, lo, hi)
    torch.testing.assert_close(got[0, :-1], torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    assert got[0, -1] == 1.0


def test_estimator_state_reports_the_weights_and_checkpoints_nothing():
    b = _batch(torch.Generator().manual_seed(7), 2.0)
    state = ADVANTAGE_ESTIMATORS.info("taspo").make_state(lam=0.5)
    got = EST(b, state=state)
    assert torch.equal(got, EST(b))  # the state only watches
    _, w, _, n = taspo_weights(b)
    m = state.metrics()
    assert m["adv/taspo_weight_dev"] == pytest.approx(float(((w - 1).abs() * n).sum() / n.sum()))
    assert m["adv/taspo_weight_max"] == pytest.approx(float(w[n > 0].max()))
    assert m["adv/turns_per_seq"] == pytest.approx(float((n > 0).sum(1).double().mean()))
    assert m["adv/taspo_weight_dev"] > 0 and state.state_dict() == {}


def test_bad_knobs_and_missing_inputs_are_named():
    b = _batch(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="lam"):
        EST(b, lam=1.0)
    with pytest.raises(ValueError, match="w_lo"):
        EST(b, w_lo=1.5)
    del b.token_extras["pi_logprobs"]
    with pytest.raises(ValueError, match="pi_logprobs"):
        EST(b)
    b.old_logprobs = None
    with pytest.raises(ValueError, match="old_logprobs"):
        EST(b)


def test_example_loads():
    cfg = load_example("taspo")
    assert cfg["advantage"]["estimator"] == "taspo" and cfg["method"]["name"] == "taspo"
