"""Rubric Dropout: equals reference/reward_shaping.py; the method's invariants: mask
shared within a group, keep fraction -> 1−p, p = 0 and evaluation use the full rubric, reward range."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.reward_shaping as rr
from megarl.rewards.shaping import build_reward_shaping
from megarl.rewards.shaping.rubric_dropout import RubricDropout, keep_mask
from tests.methods.helpers import load_example


@st.composite
def rubric_batches(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    K = draw(st.integers(1, 6))
    uids = torch.tensor([100 + g for g, n in enumerate(sizes) for _ in range(n)])
    B = uids.numel()
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    n_crit = {int(u): draw(st.integers(0, K)) for u in torch.unique(uids)}
    valid = torch.stack([torch.arange(K) < n_crit[int(u)] for u in uids])
    w_prompt = {int(u): torch.randint(-1, 4, (K,), generator=g).double() for u in torch.unique(uids)}
    weights = torch.stack([w_prompt[int(u)] for u in uids]) * valid
    scores = (
        torch.rand(B, K, generator=g, dtype=torch.float64).round()
        if draw(st.booleans())
        else torch.rand(B, K, generator=g, dtype=torch.float64)
    )
    return scores, weights, valid, uids


@settings(max_examples=30)
@given(
    rubric_batches(), st.sampled_from([0.0, 0.3, 0.5, 0.9]), st.integers(0, 50), st.booleans(), st.booleans()
)
def test_matches_reference(data, p, step, train, pitfalls):
    scores, weights, valid, uids = data
    R = RubricDropout(p, seed=7, keep_pitfalls=pitfalls)(scores, weights, valid, uids, step, train)
    ref = rr.rubric_dropout(scores, weights, valid, uids, step, p, 7, train, pitfalls)
    torch.testing.assert_close(R, ref, rtol=1e-12, atol=1e-12)


@settings(max_examples=30)
@given(rubric_batches(), st.sampled_from([0.3, 0.5]), st.integers(0, 50))
def test_mask_shared_within_group_and_full_rubric_at_p0_and_evaluation(data, p, step):
    scores, weights, valid, uids = data
    rd = RubricDropout(p)
    M = rd.masks(valid, uids, step)
    for u in torch.unique(uids):
        rows = M[uids == u]
        assert bool((rows == rows[0]).all())
        if bool(valid[uids == u][0].any()):
            assert bool(rows[0].any())  # never all dropped
    full = RubricDropout(0.0)(scores, weights, valid, uids, step)
    assert torch.equal(rd(scores, weights, valid, uids, step, train=False), full)
    assert torch.equal(RubricDropout(0.0).masks(valid, uids, step), valid)


def test_keep_fraction_tends_to_one_minus_p_and_masks_change_across_steps():
    for p in (0.3, 0.5):
        kept = torch.stack([keep_mask(0, s, u, 10, p) for s in range(200) for u in range(10)]).double().mean()
        assert abs(float(kept) - (1 - p)) < 0.02
    assert len({tuple(keep_mask(0, s, 1, 8, 0.5).tolist()) for s in range(20)}) > 5


@settings(max_examples=30)
@given(rubric_batches(), st.integers(0, 9))
def test_reward_stays_in_range_for_non_negative_weights(data, step):
    scores, weights, valid, uids = data
    w = weights.clamp(min=0)
    R = RubricDropout(0.5)(scores, w, valid, uids, step)
    assert bool(((R >= 0) & (R <= 1 + 1e-12)).all())


def test_kept_criteria_tell_the_judge_what_to_score_and_bad_input_is_named():
    valid = torch.ones(2, 4, dtype=torch.bool)
    w = torch.tensor([[1.0, 1.0, -1.0, 1.0]] * 2)
    rd = RubricDropout(0.9, seed=3)
    kc = rd.kept_criteria(valid, torch.tensor([5, 5]), step=1, weights=w)
    assert bool(kc[:, 2].all())  # the pitfall is always scored
    with pytest.raises(ValueError, match="same shape"):
        rd(torch.zeros(2, 3), w, valid, torch.tensor([5, 5]), 1)
    with pytest.raises(ValueError, match="prompt 5 has different criteria"):
        rd.masks(torch.tensor([[True, True], [True, False]]), torch.tensor([5, 5]), 1)
    with pytest.raises(ValueError, match="p=1.0"):
        RubricDropout(1.0)


def test_example_loads():
    rd = build_reward_shaping(load_example("rubric-dropout")["reward"])
    assert isinstance(rd, RubricDropout) and rd.p == 0.3
