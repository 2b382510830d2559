"""GEPO: packed estimator equals reference/credit.py (advantages and history update), with the
entropy computed from vocab-parallel logits at TP=1 and TP=2; the method's invariants."""

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.credit as rc
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import grpo
from megarl.batch import unpack
from megarl.methods.credit.gepo import GEPOHistory, gepo, group_entropy
from megarl.ops.vocab_parallel import vocab_parallel_entropy
from megarl.testing.simulated_group import SimulatedWorld
from reference.logprobs import entropy as ref_entropy
from tests.methods.helpers import load_example
from tests.property.test_advantages import reward_batches

HISTORIES = st.one_of(
    st.none(), st.tuples(st.floats(0, 3), st.floats(0, 1)).map(lambda t: (t[0], t[0] ** 2 + t[1]))
)


def _reference(b, hist, k, beta):
    p = unpack(b)
    mean, sq = (None, None) if hist is None else hist
    return rc.gepo(b.rewards, b.group_ids, p.per_token["entropies"], p.loss_mask, mean, sq, k, beta)


@settings(max_examples=25)
@given(reward_batches(), HISTORIES, st.sampled_from([0.5, 1.0]), st.sampled_from([0.0, 0.9]))
def test_matches_reference_with_history_update(b, hist, k, beta):
    b.entropies = torch.rand(b.num_tokens, dtype=torch.float64) * 3
    state = GEPOHistory(beta=beta) if hist is None else GEPOHistory(hist[0], hist[1], beta)
    adv = ADVANTAGE_ESTIMATORS.get("gepo")(b, k=k, beta=beta, state=state)
    ref, mean, sq = _reference(b, hist, k, beta)
    torch.testing.assert_close(adv, (ref[b.seq_index()] * b.loss_mask).double(), rtol=1e-9, atol=1e-10)
    assert abs(state.mean - mean) < 1e-9 and abs(state.sq - sq) < 1e-9


@settings(max_examples=5)
@given(reward_batches(), st.sampled_from([8, 12]), st.sampled_from([1.0, 30.0]))
def test_entropy_from_vocab_parallel_logits_tp1_tp2(b, V, scale):
    logits = torch.randn(b.num_tokens, V, dtype=torch.float64) * scale
    for tp in (1, 2):
        ents = SimulatedWorld(tp).run(
            lambda r, g: vocab_parallel_entropy(logits.chunk(tp, -1)[r], g if tp > 1 else None, 3)  # noqa: B023 (run at once)
        )
        b.entropies = ents[0]
        adv = ADVANTAGE_ESTIMATORS.get("gepo")(b, state=GEPOHistory(1.0, 1.5))
        b.entropies = ref_entropy(logits)
        ref, _, _ = _reference(b, (1.0, 1.5), 0.5, 0.9)
        torch.testing.assert_close(adv, (ref[b.seq_index()] * b.loss_mask).double(), rtol=1e-9, atol=1e-9)


@settings(max_examples=30)
@given(reward_batches(), HISTORIES)
def test_signs_kept_magnitude_never_grows_and_in_band_is_grpo(b, hist):
    b.entropies = torch.rand(b.num_tokens, dtype=torch.float64) * 3
    h = group_entropy(b.entropies, b.loss_mask, b.cu_seqlens, b.group_ids)
    state = GEPOHistory() if hist is None else GEPOHistory(*hist)
    adv = gepo(b.rewards, b.group_ids, h, state)
    base = grpo(b.rewards, b.group_ids)
    assert bool((adv * base >= 0).all()) and bool((adv.abs() <= base.abs() + 1e-12).all())
    wide = gepo(b.rewards, b.group_ids, h, GEPOHistory(1.5, 1.5**2 + 1e6))  # σ huge: every group in band
    assert torch.equal(wide, base)


def test_attenuation_is_monotone_in_distance_from_the_threshold():
    gids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    r = torch.tensor([1.0, 0, 1, 0, 1, 0, 1, 0], dtype=torch.float64)
    h = torch.tensor([0.5, 0.5, 0.3, 0.3, 2.5, 2.5, 2.8, 2.8], dtype=torch.float64)
    adv = gepo(r, gids, h, GEPOHistory(1.5, 1.5**2 + 0.25))  # μ=1.5, σ=0.5: band [1.25, 1.75]
    base = grpo(r, gids)
    assert adv[0] < base[0] and adv[2] < adv[0]  # low entropy: positive advantages shrink more further out
    assert adv[1] == base[1] and adv[3] == base[3]  # negative ones untouched
    assert adv[5] > base[5] and adv[7] > adv[5]  # high entropy: negative advantages shrink toward 0
    assert adv[4] == base[4] and adv[6] == base[6]


def test_thresholds_use_history_before_the_current_batch():
    gids = torch.tensor([0, 0, 1, 1])
    r = torch.tensor([1.0, 0, 1, 0], dtype=torch.float64)
    h1 = torch.tensor([0.2, 0.2, 1.5, 1.5], dtype=torch.float64)
    h2 = torch.tensor([0.2, 0.2, 9.0, 9.0], dtype=torch.float64)  # group 1 changes, group 0 does not
    s = GEPOHistory(1.5, 1.5**2 + 0.25)
    a1, a2 = gepo(r, gids, h1, copy.deepcopy(s)), gepo(r, gids, h2, copy.deepcopy(s))
    assert torch.equal(a1[:2], a2[:2])  # group 0 is shaped against the history alone
    s2 = copy.deepcopy(s)
    gepo(r, gids, h1, s2)
    assert abs(s2.mean - (0.9 * 1.5 + 0.1 * 0.85)) < 1e-12  # the batch enters the EMA afterwards


def test_state_round_trip_and_missing_entropies_is_named():
    import pytest

    s = GEPOHistory(0.7, 0.9, 0.8)
    t = ADVANTAGE_ESTIMATORS.info("gepo").make_state(beta=0.8)
    t.load_state_dict(s.state_dict())
    assert t == s
    from megarl.batch import from_sequences

    b = from_sequences([[1], [1]], [[2, 3], [4]], [0, 0], rewards=[1.0, 0.0])
    with pytest.raises(ValueError, match="entropies"):
        ADVANTAGE_ESTIMATORS.get("gepo")(b)


def test_example_loads():
    assert load_example("gepo")["advantage"]["estimator"] == "gepo"
