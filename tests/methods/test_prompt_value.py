"""SAO's prompt-level value (advantage estimator ``prompt_value``) equals reference/critics.py
``prompt_value_advantage`` on packed batches (dense token rewards and outcome rewards), and its
invariants: one baseline per prompt (only the value where the prompt ends matters), A = R − V(x)
on every response token with an outcome reward, V ≡ 0 gives the Monte Carlo return, and each
sequence's advantage is its own (any data-parallel split of the sequences gives the same)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.critics as rc
from megarl.advantages.estimators import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    monte_carlo_returns,
    token_rewards,
)
from megarl.batch import unpack
from megarl.methods.critics import prompt_value  # noqa: F401  (registers prompt_value)
from tests.property.test_advantages import reward_batches

EST = ADVANTAGE_ESTIMATORS.get("prompt_value")


@settings(max_examples=20, deadline=None)
@given(reward_batches(), st.booleans())
def test_matches_reference(b, dense):
    if not dense:
        b.token_rewards = None  # the outcome reward on each sequence's last loss token
    adv = EST(b)
    tok = unpack(dataclasses.replace(b, token_rewards=token_rewards(b)))  # outcome: on the last loss token
    rewards = tok.per_token["token_rewards"]
    radv, rret = rc.prompt_value_advantage(rewards, tok.per_token["values"], tok.loss_mask)
    am = tok.attention_mask
    torch.testing.assert_close(adv, radv[am], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b.returns.double(), rret[am], rtol=1e-12, atol=1e-12)
    # one baseline per prompt: values away from the first loss token do not matter
    first = _first_loss_tokens(b)
    other = dataclasses.replace(b, values=torch.where(first, b.values, b.values + 7.0))
    torch.testing.assert_close(EST(other), adv, rtol=0, atol=1e-12)
    # each sequence's advantage is its own: a split over two data-parallel ranks gives the same
    half = b.num_seqs // 2
    for ids in (list(range(half)), list(range(half, b.num_seqs))):
        if ids:
            part = b.select(ids)
            torch.testing.assert_close(EST(part), adv[_tokens_of(b, ids)], rtol=0, atol=1e-12)


def _first_loss_tokens(b):
    out = torch.zeros(b.num_tokens, dtype=torch.bool)
    for s, e in zip(b.cu_seqlens[:-1].tolist(), b.cu_seqlens[1:].tolist()):
        on = torch.nonzero(b.loss_mask[s:e] > 0).flatten()
        if on.numel():
            out[s + int(on[0])] = True
    return out


def _tokens_of(b, ids):
    return torch.cat([torch.arange(int(b.cu_seqlens[i]), int(b.cu_seqlens[i + 1])) for i in ids])


@given(reward_batches())
@settings(max_examples=10, deadline=None)
def test_outcome_reward_gives_r_minus_prompt_value_and_zero_values_the_return(b):
    b.token_rewards = None
    adv = compute_advantages(b, "prompt_value").double()
    first = _first_loss_tokens(b)
    seq = b.seq_index()
    m = b.loss_mask > 0
    v_x = torch.zeros(b.num_seqs, dtype=torch.float64)
    v_x[seq[first]] = b.values[first]
    torch.testing.assert_close(adv[m], (b.rewards[seq] - v_x[seq])[m].float().double(), rtol=1e-6, atol=1e-6)
    zero = dataclasses.replace(b, values=torch.zeros_like(b.values))
    torch.testing.assert_close(EST(zero), monte_carlo_returns(b, 1.0), rtol=0, atol=1e-12)


def test_needs_values():
    from tests.property.strategies import build_batch

    b = build_batch([1], [3], [0], [0, 0, 0], 8, torch.Generator().manual_seed(0), torch.float64)
    b.rewards = torch.ones(1, dtype=torch.float64)
    with pytest.raises(ValueError, match="'values'"):
        EST(b)
