"""DASH: packed segment credit equals reference/credit.py; the method's invariants."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.credit as rc
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import grpo
from megarl.batch import from_sequences, unpack
from megarl.methods.credit.dash import answer_checkpoints, checkpoints_to_extras
from tests.methods.helpers import load_example
from tests.property.test_advantages import reward_batches


@st.composite
def dash_batches(draw):
    b = draw(reward_batches())
    cps = []
    for i in range(b.num_seqs):
        lo, hi = int(b.prompt_lens[i]) + 1, int(b.seq_lens[i])
        ends = sorted(draw(st.sets(st.integers(lo, hi), max_size=3))) if hi >= lo else []
        cps.append([(e, draw(st.integers(0, 1))) for e in ends])
    b.extras.update(checkpoints_to_extras(cps))
    return b, cps


@settings(max_examples=25)
@given(dash_batches(), st.sampled_from([0.0, 0.5]), st.sampled_from([0.0, 0.25]))
def test_matches_reference(bc, beta, beta_drift):
    b, cps = bc
    adv = ADVANTAGE_ESTIMATORS.get("dash")(b, beta=beta, beta_drift=beta_drift)
    p = unpack(b)
    ref = rc.dash(b.rewards, b.group_ids, p.loss_mask, b.prompt_lens, cps, beta, beta_drift)
    torch.testing.assert_close(adv, ref[p.attention_mask], rtol=1e-12, atol=1e-12)


@settings(max_examples=30)
@given(dash_batches())
def test_single_checkpoint_is_grpo_plus_a_constant_shift_and_none_is_grpo(bc):
    b, cps = bc
    base = grpo(b.rewards, b.group_ids)
    adv = ADVANTAGE_ESTIMATORS.get("dash")(b, beta=0.5, beta_drift=0.25)
    seq, m = b.seq_index(), b.loss_mask.bool()
    for i, c in enumerate(cps):
        tok = m & (seq == i)
        if len(c) == 0:
            assert torch.equal(adv[tok], base[i].expand(int(tok.sum())))
        elif len(c) == 1:
            cK = c[0][1]
            torch.testing.assert_close(
                adv[tok], (base[i] + 0.5 * (2 * cK - 1) + 0.25 * cK).expand(int(tok.sum()))
            )


@settings(max_examples=30)
@given(dash_batches())
def test_drift_terms_telescope_to_final_correctness(bc):
    b, cps = bc
    with_drift = ADVANTAGE_ESTIMATORS.get("dash")(b, beta=0.5, beta_drift=1.0)
    no_drift = ADVANTAGE_ESTIMATORS.get("dash")(b, beta=0.5, beta_drift=0.0)
    start = b.cu_seqlens[:-1]
    for i, c in enumerate(cps):
        if not c:
            continue
        # one token per segment: the last token of segment k sits at position end_k − 1
        d = [
            float(with_drift[int(start[i]) + e - 1] - no_drift[int(start[i]) + e - 1])
            for e, _ in c
            if b.loss_mask[int(start[i]) + e - 1] == 1
        ]
        if len(d) == len(c):
            assert abs(sum(d) - c[-1][1]) < 1e-12  # Σ_k d_k = c_K − c_0, c_0 = 0


def test_checkpoint_extraction_maps_segment_boundaries_onto_token_indices():
    toks = ["Let", " x", "=", "\\boxed{", "4", "}", " wait", ",", " \\boxed{5}", " done"]
    cps = answer_checkpoints(toks, prompt_len=3, ground_truth="5")
    assert cps == [(3 + 5 + 1, 0), (3 + 8 + 1, 1)]
    b = from_sequences(
        [[7, 7, 7], [7, 7, 7]],
        [list(range(10)), list(range(10))],
        [0, 0],
        rewards=torch.tensor([1.0, 0.0], dtype=torch.float64),
    )
    b.extras.update(checkpoints_to_extras([cps, []]))
    adv = ADVANTAGE_ESTIMATORS.get("dash")(b, beta=0.5, beta_drift=0.5)
    a0 = adv[3:13]
    base = float(grpo(b.rewards, b.group_ids)[0])
    # tokens 0..5 (answer "4", wrong): −β; tokens 6..9 (drift-corrected to "5"): +β + β'
    torch.testing.assert_close(a0, torch.tensor([base - 0.5] * 6 + [base + 1.0] * 4, dtype=torch.float64))
    assert torch.equal(
        adv[16:26], torch.full((10,), float(grpo(b.rewards, b.group_ids)[1]), dtype=torch.float64)
    )


def test_missing_extras_and_unsorted_checkpoints_are_named():
    import pytest

    b = from_sequences([[1]], [[2, 3]], [0], rewards=[1.0])
    with pytest.raises(ValueError, match="dash_ends"):
        ADVANTAGE_ESTIMATORS.get("dash")(b)
    b.extras = {"dash_ends": torch.tensor([[3, 2]]), "dash_correct": torch.tensor([[1.0, 0.0]])}
    with pytest.raises(ValueError, match="sequence 0.*ascending"):
        ADVANTAGE_ESTIMATORS.get("dash")(b)


def test_example_loads():
    assert load_example("dash")["advantage"]["estimator"] == "dash"
