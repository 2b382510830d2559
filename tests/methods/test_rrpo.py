"""RRPO: set-contrastive head loss, anchor scores and group-centred advantages equal
reference/reward_shaping.py; the method's invariants."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.reward_shaping as rr
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import dr_grpo
from megarl.batch import from_sequences
from megarl.methods.credit.rrpo import (
    ProjectionHead,
    anchor_scores,
    mean_pool,
    sample_anchors,
    supcon_loss,
    train_head,
)
from tests.methods.helpers import load_example
from tests.property.test_advantages import reward_batches

SETS = st.tuples(st.integers(2, 5), st.integers(0, 4), st.integers(2, 6), st.integers(0, 2**31 - 1))


@settings(max_examples=20)
@given(SETS, st.sampled_from([0.1, 0.5, 1.0]))
def test_supcon_loss_and_gradient_match_reference(sizes, tau):
    P, N, d, seed = sizes
    g = torch.Generator().manual_seed(seed)
    pos = torch.randn(P, d, generator=g, dtype=torch.float64, requires_grad=True)
    neg = torch.randn(N, d, generator=g, dtype=torch.float64, requires_grad=True)
    loss = supcon_loss(pos, neg, tau)
    ref = rr.rrpo_supcon_loss(pos, neg, tau)
    torch.testing.assert_close(loss, ref)
    g1 = torch.autograd.grad(loss, (pos, neg), allow_unused=True)
    g2 = torch.autograd.grad(ref, (pos, neg), allow_unused=True)
    for a, b in zip(g1, g2):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b)


@settings(max_examples=20)
@given(SETS, st.integers(1, 5))
def test_scores_match_reference(sizes, B):
    P, N, d, seed = sizes
    torch.manual_seed(seed)
    head = ProjectionHead(d, 8, 16).double().freeze()
    resp, pos, neg = (torch.randn(n, d, dtype=torch.float64) for n in (B, P, N))
    with torch.no_grad():
        ref = rr.rrpo_scores(head(resp), head(pos), head(neg))
    torch.testing.assert_close(anchor_scores(head, resp, pos, neg), ref)


@settings(max_examples=20)
@given(reward_batches(), st.floats(-3, 3), st.booleans())
def test_advantages_centred_shift_invariant_and_reference(b, shift, scale):
    s = torch.randn(b.num_seqs, dtype=torch.float64)
    b.extras["rrpo_scores"] = s
    adv = ADVANTAGE_ESTIMATORS.get("rrpo")(b, scale_by_std=scale)
    torch.testing.assert_close(adv, rr.rrpo_advantages(s, b.group_ids, scale)[b.seq_index()] * b.loss_mask)
    per_seq = rr.rrpo_advantages(s, b.group_ids, scale)
    for gid in torch.unique(b.group_ids):
        assert abs(float(per_seq[b.group_ids == gid].sum())) < 1e-9
    b.extras["rrpo_scores"] = s + shift
    torch.testing.assert_close(
        ADVANTAGE_ESTIMATORS.get("rrpo")(b, scale_by_std=scale), adv, rtol=1e-9, atol=1e-9
    )
    # scores equal to the correctness indicator: Dr.GRPO
    b.extras["rrpo_scores"] = b.rewards
    torch.testing.assert_close(
        ADVANTAGE_ESTIMATORS.get("rrpo")(b), dr_grpo(b.rewards, b.group_ids)[b.seq_index()] * b.loss_mask
    )


def test_contrastive_loss_decreases_on_a_separable_toy_and_frozen_head_gets_no_gradient():
    torch.manual_seed(0)
    d = 6
    anchors = []
    for _ in range(3):  # positives around +u, negatives around −u
        u = torch.randn(d)
        anchors.append((u + 0.8 * torch.randn(5, d), -u + 0.8 * torch.randn(5, d)))
    head = ProjectionHead(d, 8, 16)
    hist = train_head(head, anchors, steps=60, lr=1e-2)
    assert hist[-1] < 0.8 * hist[0]
    head.freeze()
    resp = torch.randn(4, d, requires_grad=True)
    s = anchor_scores(head, resp, anchors[0][0], anchors[0][1])
    assert not s.requires_grad and all(p.grad is None and not p.requires_grad for p in head.parameters())
    # trained head ranks a positive-like response above a negative-like one
    u_pos, u_neg = anchors[0][0].mean(0, keepdim=True), anchors[0][1].mean(0, keepdim=True)
    sc = anchor_scores(head, torch.cat([u_pos, u_neg]), anchors[0][0], anchors[0][1])
    assert sc[0] > sc[1]


def test_mean_pool_and_anchor_sampling_through_an_engine():
    import asyncio

    from tests.methods.judge_engines import ScriptedJudgeEngine, tiny_tokenizer

    b = from_sequences([[1], [1]], [[2, 3], [4]], [0, 0], rewards=[1.0, 0.0])
    hidden = torch.arange(10, dtype=torch.float64).reshape(5, 2)
    torch.testing.assert_close(
        mean_pool(hidden, b.loss_mask, b.cu_seqlens),
        torch.tensor([[3.0, 4.0], [8.0, 9.0]], dtype=torch.float64),
    )
    tok = tiny_tokenizer()
    engine = ScriptedJudgeEngine(tok, lambda p: "good" if "gold" in p else "bad")
    pos, neg = asyncio.run(
        sample_anchors(engine, tok.encode("hint: gold"), tok.encode("hint: corrupted"), n=2)
    )
    assert [tok.decode(t) for t in pos] == ["good"] and [tok.decode(t) for t in neg] == ["bad"]


def test_errors_are_named_and_example_loads():
    with pytest.raises(ValueError, match="rrpo_scores"):
        ADVANTAGE_ESTIMATORS.get("rrpo")(from_sequences([[1]], [[2]], [0], rewards=[1.0]))
    with pytest.raises(ValueError, match=">= 2 positive anchors"):
        supcon_loss(torch.randn(1, 3), torch.randn(2, 3))
    assert load_example("rrpo")["advantage"]["estimator"] == "rrpo"
