"""Optimal token baseline: megarl equals reference/peers.py, the estimator's invariants, and its
Σπ² input through the real embedded engine."""

import asyncio
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.peers as rp
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import dr_grpo
from megarl.batch import from_sequences, unpack
from megarl.methods.peers.otb import SumPiSquared, optimal_token_baseline
from megarl.plugin.rounds import RolloutRound
from megarl.rollout.types import SamplingParams
from tests.methods.judge_engines import tiny_embedded_judge, tiny_tokenizer
from tests.property.test_advantages import reward_batches


def _inputs(b, seed):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b.num_tokens, generator=g, dtype=torch.float64) * 3
    spp = torch.exp(old) ** 2 + torch.rand(b.num_tokens, generator=g, dtype=torch.float64) * 0.5
    return old, spp


@settings(max_examples=40)
@given(reward_batches(), st.integers(0, 2**31 - 1))
def test_matches_reference(b, seed):
    old, spp = _inputs(b, seed)
    got = optimal_token_baseline(b.rewards, old, spp, b.loss_mask, b.cu_seqlens, b.group_ids)
    pad = unpack(b)
    am = pad.attention_mask

    def padded(x):
        out = torch.zeros(am.shape, dtype=torch.float64)
        out[am] = x
        return out

    want = rp.optimal_token_baseline(b.rewards, padded(old), padded(spp), pad.loss_mask, b.group_ids)[am]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@settings(max_examples=30)
@given(reward_batches(), st.integers(0, 2**31 - 1))
def test_weighted_residuals_vanish_per_position(b, seed):
    """Σ_i W_{i,k}(R_i − B_k) = ε·B_k ≈ 0 over a group's responses with a k-th token."""
    old, spp = _inputs(b, seed)
    adv = optimal_token_baseline(b.rewards, old, spp, b.loss_mask, b.cu_seqlens, b.group_ids, eps=0.0)
    pad = unpack(b)
    am, m = pad.attention_mask, pad.loss_mask.bool()
    A = torch.zeros(am.shape, dtype=torch.float64)
    A[am] = adv
    Wp = torch.zeros(am.shape, dtype=torch.float64)
    Wp[am] = (1 - 2 * torch.exp(old) + spp) * b.loss_mask.double()
    Wc = torch.cumsum(Wp, 1)
    for g in torch.unique(b.group_ids):
        members = (b.group_ids == g).nonzero().flatten().tolist()
        if len(members) < 2:
            continue
        cols = {i: m[i].nonzero().flatten() for i in members}
        for k in range(max(len(c) for c in cols.values())):
            have = [i for i in members if len(cols[i]) > k]
            s = sum(float(Wc[i, cols[i][k]] * A[i, cols[i][k]]) for i in have)
            assert abs(s) < 1e-8 * (1 + sum(abs(float(Wc[i, cols[i][k]])) for i in have))


def test_constant_score_norm_and_equal_lengths_give_dr_grpo_and_a_lone_response_keeps_its_reward():
    b = from_sequences([[1]] * 5, [[2, 3, 4]] * 4 + [[5, 6]], [0, 0, 0, 0, 7])
    b.rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 3.0], dtype=torch.float64)
    T = b.num_tokens
    old = torch.full((T,), math.log(0.5), dtype=torch.float64)
    spp = torch.full((T,), 0.5, dtype=torch.float64)  # w = 1 − 1 + 0.5 everywhere
    adv = optimal_token_baseline(b.rewards, old, spp, b.loss_mask, b.cu_seqlens, b.group_ids)
    want = dr_grpo(b.rewards, b.group_ids)
    want[4] = 3.0  # group of one: baseline 0
    torch.testing.assert_close(adv, want[b.seq_index()] * b.loss_mask.double(), rtol=1e-7, atol=1e-7)


def test_values_must_cover_exactly_the_loss_tokens():
    b = from_sequences([[1], [1]], [[2, 3], [4]], [0, 0])
    b.rewards = torch.tensor([1.0, 0.0])
    b.old_logprobs = torch.zeros(b.num_tokens)
    b.extras["sum_pi_squared"] = torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64)
    with pytest.raises(ValueError, match="sequence 1 has 1 loss tokens but 2 values"):
        ADVANTAGE_ESTIMATORS.get("otb")(b)
    b.extras["sum_pi_squared"][1, 1] = math.nan
    assert ADVANTAGE_ESTIMATORS.get("otb")(b).shape == (b.num_tokens,)


def test_sum_pi_squared_through_the_embedded_engine(tmp_path):
    """Σ_v π_v² of the real model at each generated token: in (0, 1], at least π(sampled token)²
    (the engine's own log-prob at temperature 1), NaN-padded to the width."""
    engine = tiny_embedded_judge(tmp_path)
    tok = tiny_tokenizer()
    prompt = tok.encode("one two three")

    async def gen():
        return await engine.generate(prompt, n=2, sampling=SamplingParams(max_new_tokens=5, seed=3))

    res = asyncio.run(gen())
    proc = SumPiSquared(engine.model, 1.0, width=6)
    r = RolloutRound(
        prompts=["p"],
        answers=["a"],
        uids=[0],
        prompt_ids=[prompt],
        response_ids=[s.token_ids for s in res.samples],
        texts=["x", "y"],
        dims={},
        scalar=torch.zeros(2),
        n=2,
        step=0,
        round=0,
    )
    out = asyncio.run(proc.process(r))
    rows = out.extras["sum_pi_squared"]
    assert len(rows) == 2 and all(len(row) == 6 for row in rows)
    for row, s in zip(rows, res.samples):
        vals = [v for v in row if not math.isnan(v)]
        assert len(vals) == len(s.token_ids)
        for v, lp in zip(vals, s.logprobs):
            assert 0 < v <= 1 + 1e-9 and v >= math.exp(lp) ** 2 * (1 - 1e-4)
