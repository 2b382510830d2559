"""The peers' outcome-reward estimators (OPO, GRPO pass@k, ReMax): megarl equals
reference/peers.py, the estimators' invariants, and ReMax's greedy baseline through a real engine."""

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.peers as rp
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import dr_grpo
from megarl.methods.peers.outcome import grpo_passk_advantages, opo_advantages
from megarl.methods.peers.remax import GreedyBaseline, remax_advantages
from megarl.plugin.rounds import RolloutRound
from megarl.rewards.compute import RewardComputer
from megarl.rollout.types import SamplingParams
from megarl.trainer.config_sections import RewardConfig, RewardFunctionConfig
from tests.methods.judge_engines import tiny_embedded_judge
from tests.property.test_advantages import reward_batches


def _close(x, y):
    torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def _multi(b):
    return torch.stack([(b.group_ids == g).sum() > 1 for g in b.group_ids])


# ------------------------------------------------------------------------------------------ OPO


@settings(max_examples=30)
@given(reward_batches())
def test_opo_matches_reference(b):
    lens = b.response_lens()
    _close(opo_advantages(b.rewards, b.group_ids, lens), rp.opo_advantages(b.rewards, b.group_ids, lens))
    tok = ADVANTAGE_ESTIMATORS.get("opo")(b)
    _close(tok, opo_advantages(b.rewards, b.group_ids, lens)[b.seq_index()] * b.loss_mask.double())


@settings(max_examples=30)
@given(reward_batches(), st.integers(1, 9))
def test_opo_length_weighted_sum_is_zero_and_equal_lengths_give_dr_grpo(b, n):
    lens = b.response_lens()
    adv = opo_advantages(b.rewards, b.group_ids, lens)
    for g in torch.unique(b.group_ids):
        idx = b.group_ids == g
        if idx.sum() > 1 and lens[idx].sum() > 0:
            assert abs(float((lens[idx] * adv[idx]).sum())) < 1e-9
    same = torch.full_like(lens, n)
    multi = _multi(b)
    _close(opo_advantages(b.rewards, b.group_ids, same)[multi], dr_grpo(b.rewards, b.group_ids)[multi])


def test_opo_longer_responses_weigh_more_in_the_baseline():
    r = torch.tensor([1.0, 0.0], dtype=torch.float64)
    adv = opo_advantages(r, torch.tensor([0, 0]), torch.tensor([3, 1]))
    _close(adv, torch.tensor([0.25, -0.75], dtype=torch.float64))  # baseline (3·1 + 1·0)/4


# -------------------------------------------------------------------------------- GRPO pass@k


@settings(max_examples=30)
@given(reward_batches(), st.booleans())
def test_passk_matches_reference(b, scale):
    if not bool(_multi(b).all()):
        with pytest.raises(ValueError, match="at least 2 responses per group"):
            grpo_passk_advantages(b.rewards, b.group_ids, scale)
        return
    _close(
        grpo_passk_advantages(b.rewards, b.group_ids, scale),
        rp.grpo_passk_advantages(b.rewards, b.group_ids, scale),
    )


@settings(max_examples=30)
@given(reward_batches())
def test_passk_only_the_best_learns_by_its_margin(b):
    if not bool(_multi(b).all()):
        return
    adv = grpo_passk_advantages(b.rewards, b.group_ids, scale_by_std=False)
    for g in torch.unique(b.group_ids):
        idx = (b.group_ids == g).nonzero().flatten()
        a, r = adv[idx], b.rewards[idx]
        assert int((a != 0).sum()) <= 1 and float(a.min()) >= 0
        top2 = torch.topk(r, 2).values
        _close(a.sum(), top2[0] - top2[1])
        if (a != 0).any():
            assert r[a != 0] == r.max()


def test_passk_with_two_successes_gives_nothing():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    adv = grpo_passk_advantages(r, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    assert torch.equal(adv[:4], torch.zeros(4, dtype=torch.float64))
    assert adv[4] > 0 and torch.equal(adv[5:], torch.zeros(3, dtype=torch.float64))


# ---------------------------------------------------------------------------------------- ReMax


@settings(max_examples=30)
@given(reward_batches())
def test_remax_matches_reference_and_a_baseline_equal_to_the_reward_gives_zero(b):
    base = b.rewards.flip(0)
    _close(remax_advantages(b.rewards, base), rp.remax_advantages(b.rewards, base))
    b.extras["remax_baseline"] = base
    _close(ADVANTAGE_ESTIMATORS.get("remax")(b), (b.rewards - base)[b.seq_index()] * b.loss_mask.double())
    b.extras["remax_baseline"] = b.rewards.clone()
    assert torch.equal(ADVANTAGE_ESTIMATORS.get("remax")(b), torch.zeros(b.num_tokens, dtype=torch.float64))


def test_remax_without_its_input_is_named():
    from megarl.batch import from_sequences

    b = from_sequences([[1]], [[2]], [0])
    b.rewards = torch.ones(1)
    with pytest.raises(ValueError, match="remax_baseline"):
        ADVANTAGE_ESTIMATORS.get("remax")(b)


def test_greedy_baseline_scores_each_prompts_greedy_response(tmp_path):
    """The real embedded engine (tiny random Qwen3): the baseline of prompt i is the run's reward of
    its temperature-0 response, on each of its n samples. The answers are set so that the greedy
    response of prompts 0 and 2 is correct: a sampled (non-greedy) baseline would miss them."""
    from tests.methods.judge_engines import tiny_tokenizer

    engine = tiny_embedded_judge(tmp_path)
    tok = tiny_tokenizer()
    prompts = [tok.encode(t) for t in ("one two", "three", "four five six", "seven")]

    def sampling(step, rnd, i, greedy=False):
        return SamplingParams(temperature=0.0 if greedy else 1.0, max_new_tokens=4, seed=step * 100 + i)

    async def greedy_texts():
        outs = [
            await engine.generate(p, n=1, sampling=sampling(0, 0, i, True)) for i, p in enumerate(prompts)
        ]
        return [tok.decode(o.samples[0].token_ids) for o in outs]

    texts = asyncio.run(greedy_texts())
    answers = [texts[0], "no such answer", texts[2], "no such answer"]
    rewards = RewardComputer(RewardConfig(functions=[RewardFunctionConfig(kind="exact_match")]))
    proc = GreedyBaseline(engine, tok.decode, rewards, sampling)
    n = 3
    r = RolloutRound(
        prompts=["p"] * 4,
        answers=answers,
        uids=[0, 1, 2, 3],
        prompt_ids=prompts,
        response_ids=[[1]] * (4 * n),
        texts=["x"] * (4 * n),
        dims={},
        scalar=torch.zeros(4 * n),
        n=n,
        step=0,
        round=0,
    )
    out = asyncio.run(proc.process(r))
    assert out.extras["remax_baseline"] == [1.0] * n + [0.0] * n + [1.0] * n + [0.0] * n
    assert out.metrics["remax/baseline_mean"] == 0.5
    assert proc.state_dict() == {}
