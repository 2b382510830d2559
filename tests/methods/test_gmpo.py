"""GMPO: megarl equals reference/peers.py:gmpo (loss and gradient: TP 1/2, DP 1/2, micro-batches,
packed vs padded) and the method's invariants."""

import dataclasses
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.peers as rp
from megarl.batch import from_sequences
from megarl.methods.peers.gmpo import gmpo
from megarl.objectives.policy_losses import ppo
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.testing.equivalence import megarl_loss_and_grad
from tests.methods.test_gpg import on_policy
from tests.methods.trust_regions_harness import (
    aggregate,
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases


@st.composite
def gmpo_cfgs(draw):
    return ObjectiveConfig(
        policy_loss="gmpo",
        clip_low=draw(st.sampled_from([None, 0.05, 0.4])),
        clip_high=draw(st.sampled_from([None, 0.1, 0.4])),
        aggregation=draw(st.sampled_from(["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])),
    )


def _reference(case):
    cfg = case.cfg

    def fn(full, pad):
        logp, old, adv, mask = padded_inputs(full, pad)
        lo = 0.4 if cfg.clip_low is None else cfg.clip_low
        hi = 0.4 if cfg.clip_high is None else cfg.clip_high
        return aggregate(rp.gmpo(logp, old, adv, mask, lo, hi), pad, cfg.aggregation)

    return reference_method_loss_and_grad(case, fn)


@settings(max_examples=12)
@given(
    case=rl_cases(torch.float64, cfgs=gmpo_cfgs()),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_matches_reference(case, tp, dp, mb):
    assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, mb), _reference(case), case.logits)


def _sequence_advantages(case):
    b = case.batch
    adv = (b.rewards.double()[b.seq_index()] - 0.3) * b.loss_mask.double()
    return dataclasses.replace(case, batch=dataclasses.replace(b, advantages=adv.to(b.advantages.dtype)))


@settings(max_examples=10)
@given(case=rl_cases(torch.float64, cfgs=gmpo_cfgs()))
def test_ratio_one_everywhere_equals_gspo(case):
    """Every token ratio 1: GMPO's and GSPO's sequence ratios are both 1 with gradient −Ā/n ∇logp."""
    case = on_policy(_sequence_advantages(case))
    got = megarl_loss_and_grad(case, tp=2, micro_batches=2)
    gspo = dataclasses.replace(case.cfg, policy_loss="gspo", clip_low=None, clip_high=None)
    want = megarl_loss_and_grad(dataclasses.replace(case, cfg=gspo), tp=2, micro_batches=2)
    assert_equivalent(got, want, case.logits, rtol=1e-12, atol=1e-14)


@settings(max_examples=40)
@given(
    n=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    lo=st.sampled_from([0.05, 0.2, 0.4]),
    hi=st.sampled_from([0.05, 0.28, 0.4]),
)
def test_one_token_sequences_are_ppo_with_log_space_bounds(n, seed, lo, hi):
    """A single token's geometric mean is its ratio: PPO clip with ε_l = 1 − e^−lo, ε_h = e^hi − 1."""
    g = torch.Generator().manual_seed(seed)
    b = from_sequences([[1, 2]] * n, [[3]] * n, list(range(n)))
    T = b.num_tokens
    m = b.loss_mask.double()
    adv = torch.randn(T, generator=g, dtype=torch.float64) * m
    old = -torch.rand(T, generator=g, dtype=torch.float64)
    x = (old + (torch.rand(T, generator=g, dtype=torch.float64) - 0.5)).requires_grad_(True)
    y = x.detach().clone().requires_grad_(True)
    got = gmpo(x, old, adv, m, b.cu_seqlens, lo, hi) * m
    want = ppo(y, old, adv, m, b.cu_seqlens, 1 - math.exp(-lo), math.exp(hi) - 1) * m
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-14)


def test_a_token_far_past_its_bound_stops_contributing_gradient():
    b = from_sequences([[1]], [[2, 3, 4]], [0])
    m = b.loss_mask.double()
    adv = torch.tensor([0, 1.0, 1.0, 1.0], dtype=torch.float64)
    x = torch.tensor([0, 2.0, 0.0, 0.0], dtype=torch.float64, requires_grad=True)  # token 1: d = 2 > ε_h
    (gmpo(x, torch.zeros(4, dtype=torch.float64), adv, m, b.cu_seqlens) * m).sum().backward()
    assert x.grad[1] == 0 and bool((x.grad[2:] < 0).all())
