"""GiGPO: packed step-level estimator equals reference/credit.py; invariants of the anchor-state
grouping (Feng et al. 2025, arXiv 2505.10978)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.credit as rc
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import grpo
from megarl.batch import from_sequences, unpack
from megarl.methods.credit.steps import anchor_state_keys, state_key
from reference.advantages import grpo as ref_grpo
from tests.methods.agent_batches import agent_batches
from tests.methods.helpers import load_example


def _reference(b, keys, srew, spans, gamma, omega, scale):
    p = unpack(b)
    step = rc.gigpo(b.rewards, b.group_ids, keys, srew, gamma, omega, scale)
    ep = ref_grpo(b.rewards, b.group_ids, scale_by_std=scale)
    return rc.steps_to_tokens(step, ep, spans, p.loss_mask)[p.attention_mask]


@settings(max_examples=20)
@given(agent_batches(), st.sampled_from([1.0, 0.95]), st.sampled_from([0.0, 1.0, 0.5]), st.booleans())
def test_matches_reference(data, gamma, omega, scale):
    b, keys, srew, spans = data
    adv = ADVANTAGE_ESTIMATORS.get("gigpo")(b, gamma=gamma, omega=omega, scale_by_std=scale)
    torch.testing.assert_close(
        adv, _reference(b, keys, srew, spans, gamma, omega, scale), rtol=1e-10, atol=1e-10
    )


@settings(max_examples=20)
@given(agent_batches(n_states=1000))
def test_no_shared_state_or_omega_zero_is_episode_grpo(data):
    b, keys, _, _ = data
    episode = (grpo(b.rewards, b.group_ids)[b.seq_index()] * b.loss_mask).double()
    flat = [(int(b.group_ids[i]), k) for i, ks in enumerate(keys) for k in ks]
    if len(set(flat)) == len(flat):  # every anchor state unique within its group
        assert torch.equal(ADVANTAGE_ESTIMATORS.get("gigpo")(b), episode)
    assert torch.equal(ADVANTAGE_ESTIMATORS.get("gigpo")(b, omega=0.0), episode)


def test_identical_single_step_trajectories_double_the_episode_advantage():
    b = from_sequences(
        [[1], [1], [1]],
        [[2, 3], [2, 3], [2, 3]],
        [0, 0, 0],
        rewards=torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64),
        turn_spans=[[(0, 1, "prompt"), (1, 3, "assistant")]] * 3,
    )
    b.extras["step_state_keys"] = torch.zeros(3, 1, dtype=torch.long)
    adv = ADVANTAGE_ESTIMATORS.get("gigpo")(b, omega=1.0)
    ep = grpo(b.rewards, b.group_ids)
    torch.testing.assert_close(adv[b.loss_mask.bool()], (2 * ep).repeat_interleave(2))


def test_anchor_state_keys_follow_the_observation_tokens():
    spans = [
        [(0, 2, "prompt"), (2, 3, "assistant"), (3, 4, "observation"), (4, 5, "assistant")],
        [(0, 2, "prompt"), (2, 3, "assistant"), (3, 4, "observation"), (4, 5, "assistant")],
    ]
    b = from_sequences([[5, 6], [5, 6]], [[1, 9, 2], [1, 8, 2]], [0, 0], rewards=[1.0, 0.0], turn_spans=spans)
    b.loss_mask[torch.tensor([3, 8])] = 0.0  # observation tokens
    keys = anchor_state_keys(b)
    assert keys[0, 0] == keys[1, 0] == state_key([5, 6])  # same prompt: shared anchor state
    assert keys[0, 1] != keys[1, 1]  # different observations
    assert keys[0, 1] == state_key([9]) and bool((keys >= 0).all())


def test_missing_keys_and_mismatched_spans_are_named():
    import pytest

    b = from_sequences(
        [[1]], [[2, 3]], [0], rewards=[1.0], turn_spans=[[(0, 1, "prompt"), (1, 3, "assistant")]]
    )
    with pytest.raises(ValueError, match="step_state_keys"):
        ADVANTAGE_ESTIMATORS.get("gigpo")(b)
    b.extras["step_state_keys"] = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="sequence 0: 2 keys for 1 'assistant' spans"):
        ADVANTAGE_ESTIMATORS.get("gigpo")(b)


def test_example_loads():
    assert load_example("gigpo")["advantage"]["estimator"] == "gigpo"
