"""CRPO: the packed estimator (multi-turn spans, samples with and without a privileged context)
equals reference/agents.py:crpo_advantages and the PPO loss on its advantages equals the reference
loss (gradient too) at TP 1/2 with micro-batches and DP splits; the spec's invariants: an empty
privileged context gives GRPO exactly, group-centring sums to 0 per (group, turn), P and N are
disjoint, the teacher is stop-gradient."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.agents as ref
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import grpo, per_token
from megarl.batch import unpack
from megarl.methods.agents.crpo import crpo_positions, group_turn_centre
from megarl.methods.agents.privileged_gap import token_gap, turn_index
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.testing.equivalence import megarl_loss_and_grad, reference_loss_and_grad
from tests.methods.helpers import load_example
from tests.property.strategies import rl_cases

KNOBS = st.fixed_dictionaries(
    {
        "coef": st.sampled_from([1.0, 0.4]),
        "eta": st.sampled_from([0.0, 0.5, -1.0]),
        "entropy_threshold": st.sampled_from([0.3, 0.8]),
        "gap_threshold": st.sampled_from([0.0, 0.3]),
        "scale_by_std": st.booleans(),
    }
)
CFGS = st.sampled_from([ObjectiveConfig("ppo", aggregation=a) for a in ("token-mean", "seq-mean-token-sum")])


def _set_up(case, data):
    """Self-teacher logprobs, entropies, which samples have a context, and 1-2 assistant turns per
    response (split at a drawn point). Returns (on [B], turn index per token [T] built from the spans)."""
    b = case.batch
    B = b.num_seqs
    on = torch.tensor(data.draw(st.lists(st.booleans(), min_size=B, max_size=B)))
    b.self_teacher_logprobs = b.teacher_logprobs.clone()
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    b.entropies = torch.rand(b.num_tokens, generator=g, dtype=torch.float64) * 1.2
    b.extras = {"self_teacher_on": on.double()}
    spans, turn = [], torch.full((b.num_tokens,), -1, dtype=torch.long)
    for i in range(B):
        s, p, n = int(b.cu_seqlens[i]), int(b.prompt_lens[i]), int(b.seq_lens[i])
        cut = data.draw(st.integers(p, n)) if n > p else p
        sp = [(0, p, "prompt")] + [(a, c, "assistant") for a, c in ((p, cut), (cut, n)) if c > a]
        spans.append(sp)
        for k, (a, c, _) in enumerate(sp[1:]):
            turn[s + a : s + c] = k
    b.turn_spans = spans
    return on, turn


@settings(max_examples=3, deadline=None)
@given(
    rl_cases(torch.float64, cfgs=CFGS),
    KNOBS,
    st.sampled_from([(1, 1, 1), (2, 2, 1), (1, 2, 3), (2, 1, 2)]),
    st.data(),
)
def test_advantages_and_loss_match_reference_tp_dp_micro(case, knobs, layout, data):
    on, turn = _set_up(case, data)
    b = case.batch
    assert torch.equal(turn_index(b), turn)
    adv = ADVANTAGE_ESTIMATORS.get("crpo")(b, **knobs)
    p = unpack(b)
    t = p.per_token
    pad_turn = torch.full(p.attention_mask.shape, -1, dtype=torch.long)
    pad_turn[p.attention_mask] = turn
    pad_ent = torch.zeros(p.attention_mask.shape, dtype=torch.float64)
    pad_ent[p.attention_mask] = b.entropies
    want, pos, neg = ref.crpo_advantages(
        b.rewards,
        b.group_ids,
        t["self_teacher_logprobs"],
        t["old_logprobs"],
        pad_ent,
        p.loss_mask,
        pad_turn,
        on,
        **knobs,
    )
    torch.testing.assert_close(adv, want[p.attention_mask], rtol=1e-12, atol=1e-12)
    gap = token_gap(b, b.self_teacher_logprobs, on, "x")
    got_pos, got_neg = crpo_positions(b, gap, knobs["entropy_threshold"], knobs["gap_threshold"])
    assert torch.equal(got_pos, pos[p.attention_mask]) and torch.equal(got_neg, neg[p.attention_mask])
    assert not bool((got_pos & got_neg).any())  # P and N are disjoint
    b.advantages = adv
    tp, dp, mb = layout
    ref_loss, ref_grad = reference_loss_and_grad(case)
    loss, grad = megarl_loss_and_grad(case, tp=tp, dp=dp, micro_batches=min(mb, b.num_seqs))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_loss.abs())))
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_grad.abs().max())))


@settings(max_examples=5, deadline=None)
@given(rl_cases(torch.float64), st.data())
def test_centring_sums_to_zero_per_group_turn_and_no_context_is_grpo(case, data):
    on, turn = _set_up(case, data)
    b = case.batch
    live = b.loss_mask.bool() & on.repeat_interleave(b.seq_lens)
    gap = token_gap(b, b.self_teacher_logprobs, on, "x")
    c = group_turn_centre(b, gap, live)
    grp = b.group_ids.repeat_interleave(b.seq_lens)
    for g in grp.unique():
        for k in turn.unique():
            sel = live & (grp == g) & (turn == k)
            assert abs(float(c[sel].sum())) < 1e-9
    assert bool((c[~live] == 0).all())
    b.extras["self_teacher_on"] = torch.zeros(b.num_seqs, dtype=torch.float64)  # no privileged context
    adv = ADVANTAGE_ESTIMATORS.get("crpo")(b, eta=0.5, gap_threshold=0.0)
    assert torch.equal(adv, per_token(b, grpo(b.rewards.double(), b.group_ids)))


def test_teacher_is_stop_gradient_and_errors_are_named():
    import dataclasses

    from megarl.batch import from_sequences

    b = from_sequences([[1], [1]], [[2, 3], [4, 5]], [0, 0], rewards=[1.0, 0.0])
    b.old_logprobs = torch.full((b.num_tokens,), -1.0, dtype=torch.float64)
    with pytest.raises(ValueError, match="self_teacher_logprobs"):
        ADVANTAGE_ESTIMATORS.get("crpo")(b)
    b.self_teacher_logprobs = torch.full((b.num_tokens,), -0.2, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="entropies"):
        ADVANTAGE_ESTIMATORS.get("crpo")(b)
    b = dataclasses.replace(b, entropies=torch.ones(b.num_tokens, dtype=torch.float64))
    adv = ADVANTAGE_ESTIMATORS.get("crpo")(b)
    assert not adv.requires_grad
    with pytest.raises(ValueError, match="advantage.coef=-1"):
        ADVANTAGE_ESTIMATORS.get("crpo")(b, coef=-1.0)
    cfg = load_example("crpo")
    assert cfg["inputs"]["self_teacher_context"]["source"] == "sibling"
