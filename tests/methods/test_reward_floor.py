"""Reward floor against verbatim copying: equals reference/reward_shaping.py; the method's
invariants, including the GRPO-amplification demonstration."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.reward_shaping as rr
from megarl.advantages.estimators import grpo, rloo
from megarl.rewards.shaping import build_reward_shaping
from megarl.rewards.shaping.reward_floor import RewardFloor, ngram_precision
from tests.methods.helpers import load_example

WORDS = st.lists(
    st.sampled_from(["senior", "data", "engineer", "python", "remote", "ml", "Data"]), max_size=8
)


@settings(max_examples=30)
@given(
    st.lists(st.tuples(WORDS, WORDS, st.floats(0, 1)), min_size=1, max_size=6),
    st.integers(1, 4),
    st.sampled_from([0.3, 0.5, 1.0]),
)
def test_matches_reference(rows, n, theta):
    responses = [" ".join(r) for r, _, _ in rows]
    sources = [" ".join(s) for _, s, _ in rows]
    rewards = torch.tensor([x for _, _, x in rows], dtype=torch.float64)
    out, copied = RewardFloor(n, theta, -0.5)(rewards, responses, sources)
    torch.testing.assert_close(out, rr.reward_floor(rewards, responses, sources, n, theta, -0.5))
    for i, (r, s, _) in enumerate(rows):
        p = ngram_precision([w.lower() for w in r], [w.lower() for w in s], n)
        assert p == rr.ngram_precision([w.lower() for w in r], [w.lower() for w in s], n)
        assert bool(copied[i]) == (p >= theta)


@settings(max_examples=30)
@given(st.lists(st.tuples(WORDS, WORDS, st.floats(0, 1)), min_size=1, max_size=6))
def test_copies_get_exactly_the_floor_others_unchanged_and_idempotent(rows):
    responses = [" ".join(r) for r, _, _ in rows]
    sources = [" ".join(s) for _, s, _ in rows]
    rewards = torch.tensor([x for _, _, x in rows], dtype=torch.float64)
    fl = RewardFloor()
    out, copied = fl(rewards, responses, sources)
    assert bool((out[copied] == 0.0).all()) and torch.equal(out[~copied], rewards[~copied])
    again, _ = fl(out, responses, sources)
    assert torch.equal(again, out)


def test_verbatim_copy_is_floored_and_a_rewrite_is_not():
    src = "Senior data engineer with Python and Spark experience in remote teams"
    out, copied = RewardFloor()(
        torch.tensor([0.9, 0.8]), [src.lower(), "remote python data roles"], [src, src]
    )
    assert copied.tolist() == [True, False] and out.tolist() == [0.0, pytest.approx(0.8)]


def test_grpo_amplifies_spurious_differences_rloo_does_not():
    sigma = 1e-3
    r = 0.5 + sigma * torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    gids = torch.zeros(4, dtype=torch.long)
    assert float(grpo(r, gids).abs().max()) > 0.5  # O(1)
    assert float(rloo(r, gids).abs().max()) < 10 * sigma  # O(σ)


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="threshold"):
        RewardFloor(threshold=0.0)
    with pytest.raises(ValueError, match="unknown key reward.shaping.ngram"):
        build_reward_shaping({"shaping": {"name": "reward_floor", "ngram": 3}})
    with pytest.raises(ValueError, match="reward.shaping.n='3' must be a number"):
        build_reward_shaping({"shaping": {"name": "reward_floor", "n": "3"}})


def test_example_loads():
    cfg = load_example("reward-floor")
    fl = build_reward_shaping(cfg["reward"])
    assert isinstance(fl, RewardFloor) and (fl.n, fl.threshold, fl.floor) == (3, 0.5, 0.0)
