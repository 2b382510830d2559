"""PGPO: packed potential-difference estimator equals reference/credit.py; the method's invariants:
telescoping, GRPO when no state is shared, permutation invariance."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.credit as rc
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import grpo
from megarl.batch import unpack
from megarl.methods.credit.pgpo import pgpo_step_advantages
from reference.advantages import grpo as ref_grpo
from tests.methods.agent_batches import agent_batches
from tests.methods.helpers import load_example


@settings(max_examples=15)
@given(agent_batches(), st.sampled_from([1.0, 0.9]), st.sampled_from([1.0, 0.5]), st.booleans())
def test_matches_reference(data, gamma, omega, normalise):
    b, keys, srew, spans = data
    adv = ADVANTAGE_ESTIMATORS.get("pgpo")(b, gamma=gamma, omega=omega, normalise=normalise)
    p = unpack(b)
    step = rc.pgpo(b.rewards, b.group_ids, keys, srew, gamma, omega, normalise)
    ref = rc.steps_to_tokens(step, ref_grpo(b.rewards, b.group_ids), spans, p.loss_mask)[p.attention_mask]
    torch.testing.assert_close(adv, ref, rtol=1e-10, atol=1e-10)


@settings(max_examples=20)
@given(agent_batches(n_states=10**6), st.sampled_from([1.0, 0.9]), st.booleans())
def test_no_shared_state_is_exactly_grpo(data, gamma, normalise):
    b, keys, _, _ = data
    flat = [(int(b.group_ids[i]), k) for i, ks in enumerate(keys) for k in ks]
    if len(set(flat)) == len(flat):
        adv = ADVANTAGE_ESTIMATORS.get("pgpo")(b, gamma=gamma, normalise=normalise)
        assert torch.equal(adv, (grpo(b.rewards, b.group_ids)[b.seq_index()] * b.loss_mask).double())


@settings(max_examples=20)
@given(agent_batches(with_step_rewards=False))
def test_telescoping_to_dr_grpo_with_a_shared_initial_state(data):
    b, _, _, _ = data
    b.extras["step_state_keys"][:, 0] = 99  # every trajectory starts in the same state s_0
    steps, step_adv, episode = pgpo_step_advantages(b, gamma=1.0, omega=1.0, normalise=False)
    a_s = step_adv - episode[steps.seq]
    total = torch.zeros(b.num_seqs, dtype=torch.float64).index_add(0, steps.seq, a_s)
    # Σ_t A^S_{i,t} = R_i − Φ(s_0) = R_i − mean_j R_j (un-normalised GRPO / Dr.GRPO)
    torch.testing.assert_close(
        total, grpo(b.rewards, b.group_ids, scale_by_std=False), rtol=1e-10, atol=1e-10
    )


@settings(max_examples=15)
@given(agent_batches(), st.randoms(use_true_random=False))
def test_permutation_invariant_over_trajectory_order(data, rnd):
    b, _, _, _ = data
    order = list(range(b.num_seqs))
    rnd.shuffle(order)
    adv = ADVANTAGE_ESTIMATORS.get("pgpo")(b)
    b2 = b.select(order)
    adv2 = ADVANTAGE_ESTIMATORS.get("pgpo")(b2)
    torch.testing.assert_close(
        adv2, adv[b.select(order).tokens.new_tensor(_token_perm(b, order))], rtol=1e-9, atol=1e-9
    )


def _token_perm(b, order):
    return [t for i in order for t in range(int(b.cu_seqlens[i]), int(b.cu_seqlens[i + 1]))]


def test_failed_trajectory_gets_credit_for_reaching_a_successful_state():
    from megarl.batch import from_sequences

    spans = [[(0, 1, "prompt"), (1, 2, "assistant"), (2, 3, "observation"), (3, 4, "assistant")]] * 2
    b = from_sequences(
        [[1], [1]],
        [[2, 3, 2], [2, 3, 2]],
        [0, 0],
        rewards=torch.tensor([1.0, 0.0], dtype=torch.float64),
        turn_spans=spans,
    )
    b.loss_mask[torch.tensor([2, 6])] = 0.0
    b.extras["step_state_keys"] = torch.tensor([[0, 7], [0, 7]])  # both reach state 7; only one succeeds
    steps, step_adv, episode = pgpo_step_advantages(b, gamma=1.0, omega=1.0, normalise=False)
    a_s = step_adv - episode[steps.seq]  # steps: (traj 0: s_0, s_7), (traj 1: s_0, s_7)
    # the failed trajectory's first step reached a state worth Φ = 0.5, as much as s_0: no blame;
    # its last action is what failed
    torch.testing.assert_close(a_s, torch.tensor([0.0, 0.5, 0.0, -0.5], dtype=torch.float64))


def test_example_loads():
    assert load_example("pgpo")["advantage"]["estimator"] == "pgpo"
