"""RSPO: packed estimator equals reference/reward_shaping.py in both readings; the method's invariants."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.reward_shaping as rr
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import grpo
from megarl.batch import from_sequences
from megarl.methods.credit.rspo import rspo, rspo_keep
from tests.methods.helpers import load_example
from tests.property.test_advantages import reward_batches

BASES = st.sampled_from(["grpo", "dr_grpo", "rloo"])


@st.composite
def two_reward_batches(draw):
    b = draw(reward_batches())
    proc = torch.tensor(
        draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=b.num_seqs, max_size=b.num_seqs)),
        dtype=torch.float64,
    )
    b.rewards = torch.stack([b.rewards, proc], 1)
    b.reward_names = ["outcome", "process"]
    return b


@settings(max_examples=25)
@given(two_reward_batches(), BASES, st.sampled_from(["A", "B"]))
def test_matches_reference(b, base, reading):
    out, proc = b.rewards[:, 0], b.rewards[:, 1]
    torch.testing.assert_close(
        rspo(out, proc, b.group_ids, base, reading),
        rr.rspo(out, proc, b.group_ids, base, reading),
        rtol=1e-10,
        atol=1e-10,
    )
    adv = ADVANTAGE_ESTIMATORS.get("rspo")(b, base=base, reading=reading)
    torch.testing.assert_close(
        adv, rr.rspo(out, proc, b.group_ids, base, reading)[b.seq_index()] * b.loss_mask
    )


@settings(max_examples=25)
@given(two_reward_batches(), BASES)
def test_informative_groups_unchanged_swapped_groups_zero_mean_zero_process_is_baseline(b, base):
    out, proc = b.rewards[:, 0], b.rewards[:, 1]
    adv = rspo(out, proc, b.group_ids, base)
    from megarl.methods.credit.rspo import BASES as FNS

    plain = FNS[base](out, b.group_ids)
    for g in torch.unique(b.group_ids):
        sel = b.group_ids == g
        if out[sel].max() != out[sel].min():
            assert torch.equal(adv[sel], plain[sel])
        assert abs(float(adv[sel].sum())) < 1e-9
    assert torch.equal(rspo(out, torch.zeros_like(proc), b.group_ids, base), plain)
    assert torch.equal(rspo(out, proc, b.group_ids, base, reading="B"), plain)


@settings(max_examples=25)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0.0, 0.1, 0.5, 0.9])), min_size=1, max_size=12),
    st.integers(1, 4),
)
def test_reading_b_keep_matches_reference_and_keeps_the_extremes(rows, keep):
    gids = torch.tensor([g for g, _ in rows])
    proc = torch.tensor([p for _, p in rows], dtype=torch.float64)
    kept = rspo_keep(proc, gids, keep)
    assert kept.tolist() == rr.rspo_keep(proc, gids, keep)
    for g in torch.unique(gids):
        n = int((gids == g).sum())
        in_g = [i for i in kept.tolist() if int(gids[i]) == int(g)]
        assert len(in_g) == min(n, keep)
        if keep >= 2:
            assert max(float(proc[i]) for i in in_g) == float(proc[gids == g].max())
            assert min(float(proc[i]) for i in in_g) == float(proc[gids == g].min())


def test_process_from_token_rewards_and_errors_are_named():
    b = from_sequences(
        [[1], [1]], [[2, 3], [2]], [0, 0], rewards=torch.tensor([[1.0], [1.0]], dtype=torch.float64)
    )
    b.reward_names = ["outcome"]
    with pytest.raises(ValueError, match="'process' not in reward_names"):
        ADVANTAGE_ESTIMATORS.get("rspo")(b)
    b.token_rewards = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.2])
    adv = ADVANTAGE_ESTIMATORS.get("rspo")(b)  # equal outcomes: process sums 1.0 vs 0.2 decide
    torch.testing.assert_close(
        adv[b.loss_mask.bool()],
        grpo(torch.tensor([1.0, 0.2], dtype=torch.float64), b.group_ids).repeat_interleave(
            torch.tensor([2, 1])
        ),
    )
    b.rewards = torch.tensor([1.0, 0.0])
    with pytest.raises(ValueError, match=r"rewards' \[B, K\]"):
        ADVANTAGE_ESTIMATORS.get("rspo")(b)


def test_example_loads():
    assert load_example("rspo")["advantage"] == {
        "estimator": "rspo",
        "base": "grpo",
        "reading": "A",
        "outcome": "correct",
        "process": "format",
    }
