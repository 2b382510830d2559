"""REGEN: megarl equals reference/agents.py:regen_loss (loss and gradient, TP 1/2, DP 1/2,
micro-batches, with and without replayed per-sequence labels) and the method's invariants."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.batch import from_sequences
from megarl.methods.agents.regen import regen, regen_sequence_terms
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.testing.equivalence import Case, megarl_loss_and_grad
from reference import agents as ref
from tests.methods.trust_regions_harness import (
    assert_equivalent,
    padded_inputs,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases

CFGS = st.builds(
    ObjectiveConfig,
    policy_loss=st.just("regen"),
    aggregation=st.just("seq-mean-token-sum"),
    policy_loss_args=st.fixed_dictionaries(
        {
            "alpha": st.sampled_from([1.0, 0.5, 3.0]),
            "clip_ratio_max": st.sampled_from([10.0, 1.5]),
            "length_normalize": st.booleans(),
        }
    ),
)


def _with_labels(case, seed: int):
    """Replayed episodes: a stored behaviour NLL and origin label per sequence in ``extras``."""
    b = case.batch
    g = torch.Generator().manual_seed(seed)
    nll = torch.rand(b.num_seqs, generator=g, dtype=torch.float64) * 6
    neg = (torch.rand(b.num_seqs, generator=g) < 0.5).double()
    extras = dict(b.extras, behaviour_nll=nll, origin_negative=neg)
    return dataclasses.replace(case, batch=dataclasses.replace(b, extras=extras))


def _reference(case):
    knobs = case.cfg.policy_loss_args

    def fn(full, pad):
        logp, _, adv, mask = padded_inputs(full, pad)
        m = mask.double()
        n = m.sum(-1).clamp(min=1)
        a = (adv * m).sum(-1) / n
        b = case.batch
        if "behaviour_nll" in b.extras:
            nll, neg = b.extras["behaviour_nll"], b.extras["origin_negative"].bool()
        else:
            nll, neg = -(pad.per_token["rollout_logprobs"] * m).sum(-1), a < 0
        return ref.regen_loss(logp, nll, a, neg, mask, **knobs)

    return reference_method_loss_and_grad(case, fn)


@settings(max_examples=10, deadline=None)
@given(
    case=rl_cases(torch.float64, cfgs=CFGS),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
    labels=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference(case, tp, dp, mb, labels, seed):
    if labels:
        case = _with_labels(case, seed)
    assert_equivalent(
        megarl_loss_and_grad(case, tp=tp, dp=dp, micro_batches=mb), _reference(case), case.logits
    )


def _batch(n_resp=(3, 2, 4)):
    return from_sequences([[1, 2]] * len(n_resp), [[3] * k for k in n_resp], list(range(len(n_resp))))


def _grad(b, logp, adv, **kw):
    x = logp.clone().requires_grad_(True)
    m = b.loss_mask.double()
    (regen(x, torch.zeros_like(x), adv * m, m, b.cu_seqlens, batch=b, **kw) * m).sum().backward()
    return x.grad


@given(seed=st.integers(0, 2**31 - 1), alpha=st.sampled_from([0.3, 1.0, 5.0]))
@settings(max_examples=20, deadline=None)
def test_positive_gradient_is_minus_a_grad_logp_and_negative_weight_is_bounded_constant(seed, alpha):
    """Positive: d loss/d log π_t = −A (weight exactly 1). Negative: −A·w with w ∈ [0, α], and the
    gradient is exactly that (no gradient through the weight)."""
    g = torch.Generator().manual_seed(seed)
    b = _batch()
    T, m = b.num_tokens, b.loss_mask.double()
    logp = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    b.rollout_logprobs = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    a_seq = torch.tensor([1.5, -0.7, -2.0], dtype=torch.float64)
    adv = a_seq[b.seq_index()]
    grad = _grad(b, logp, adv, alpha=alpha)
    a, w, neg, _ = regen_sequence_terms(logp, b.rollout_logprobs, adv * m, m, b.cu_seqlens, b, alpha=alpha)
    assert neg.tolist() == [False, True, True]
    assert w[0] == 1.0 and bool(((w[1:] >= 0) & (w[1:] <= alpha)).all())
    torch.testing.assert_close(grad, -(a * w)[b.seq_index()] * m, rtol=0, atol=0)
    # w from the sequence log-likelihoods themselves
    lp = torch.zeros(3, dtype=torch.float64).index_add_(0, b.seq_index(), logp * m)
    lm = torch.zeros(3, dtype=torch.float64).index_add_(0, b.seq_index(), b.rollout_logprobs * m)
    want = torch.clamp(torch.exp(torch.clamp(lp - lm, max=math.log(10.0))), 0, alpha)
    torch.testing.assert_close(w[1:], want[1:], rtol=1e-14, atol=0)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
def test_on_policy_weight_is_min_one_alpha(alpha):
    b = _batch()
    m = b.loss_mask.double()
    logp = -torch.linspace(0.1, 2.0, b.num_tokens, dtype=torch.float64)
    adv = -torch.ones(b.num_tokens, dtype=torch.float64) * m
    _, w, _, _ = regen_sequence_terms(logp, logp, adv, m, b.cu_seqlens, None, alpha=alpha)
    torch.testing.assert_close(w, torch.full((3,), min(1.0, alpha), dtype=torch.float64))


@pytest.mark.parametrize("c_max", [1.5, 10.0])
def test_ratio_cap_holds_for_huge_log_ratios(c_max):
    """log π − log μ = 1e4: the weight is min(c_max, α), finite; with α large it is c_max."""
    b = _batch((2,))
    m = b.loss_mask.double()
    logp = torch.zeros(b.num_tokens, dtype=torch.float64)
    b.extras = {"behaviour_nll": torch.tensor([1e4], dtype=torch.float64)}
    adv = -m
    for alpha, want in [(1e6, c_max), (1.0, 1.0)]:
        _, w, _, _ = regen_sequence_terms(
            logp, logp, adv, m, b.cu_seqlens, b, alpha=alpha, clip_ratio_max=c_max
        )
        assert float(w) == pytest.approx(want, rel=1e-12)
        assert torch.isfinite(_grad(b, logp, adv, alpha=alpha, clip_ratio_max=c_max)).all()


def test_all_positive_unit_advantage_is_sft():
    """A = 1 everywhere: the objective's loss and gradient are SFT's (mean over sequences of the
    summed NLL of the response tokens)."""
    torch.manual_seed(0)
    b = _batch((3, 1, 4))
    V = 8
    b.tokens = torch.randint(0, V, (b.num_tokens,))
    m = b.loss_mask.double()
    b.advantages = m.clone()
    b.rollout_logprobs = -torch.rand(b.num_tokens, dtype=torch.float64)
    logits = torch.randn(b.num_tokens, V, dtype=torch.float64) * 3
    case = Case(
        batch=b, logits=logits, cfg=ObjectiveConfig(policy_loss="regen", aggregation="seq-mean-token-sum")
    )
    got = megarl_loss_and_grad(case, tp=2, dp=2, micro_batches=2)
    x = logits.clone().requires_grad_(True)
    nll = -torch.log_softmax(x, -1).gather(-1, b.tokens[:, None]).squeeze(-1)
    sft = (nll * m).sum() / b.num_seqs
    sft.backward()
    assert_equivalent(got, (sft.detach(), x.grad), logits, rtol=1e-12, atol=1e-13)


def test_stored_labels_override_the_advantage_sign_and_rollout_logprobs():
    """A replayed label 'positive' keeps weight 1 even with A < 0; a stored NLL replaces Σ rollout logp."""
    b = _batch((2, 2))
    m = b.loss_mask.double()
    logp = torch.full((b.num_tokens,), -0.5, dtype=torch.float64)
    b.rollout_logprobs = torch.full((b.num_tokens,), -9.0, dtype=torch.float64)
    adv = -m
    _, w, _, _ = regen_sequence_terms(logp, logp, adv, m, b.cu_seqlens, b)
    assert w.tolist() == [1.0, 1.0]  # exp(min(-1 + 18, log 10)) = 10, clipped to α = 1
    b.extras = {
        "behaviour_nll": torch.tensor([0.5, 3.0], dtype=torch.float64),
        "origin_negative": torch.tensor([0.0, 1.0], dtype=torch.float64),
    }
    _, w, neg, _ = regen_sequence_terms(logp, logp, adv, m, b.cu_seqlens, b, alpha=9.0)
    assert neg.tolist() == [False, True]
    torch.testing.assert_close(w, torch.tensor([1.0, math.exp(-1.0 + 3.0)], dtype=torch.float64))


@pytest.mark.parametrize(
    "knobs, key", [({"alpha": -1.0}, "policy_loss_args.alpha"), ({"clip_ratio_max": 0.0}, "clip_ratio_max")]
)
def test_bad_knobs_are_refused_by_name(knobs, key):
    b = _batch((2,))
    m = b.loss_mask.double()
    with pytest.raises(ValueError, match=key):
        regen(torch.zeros(b.num_tokens), torch.zeros(b.num_tokens), m, m, b.cu_seqlens, **knobs)
