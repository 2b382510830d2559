"""Sequence-level truncated IS and the rejection criteria on KL estimates (token k2/k3, sequence
sum/mean/max of k1/k2/k3) equal reference/corrections.py on packed batches with masked prompt
tokens; without a trigger the rejections are plain IS and seq_tis is sequence-level IS. The
composed objective with them is covered by the equivalence tests (tests/property/strategies.py
draws seq_tis, token_k3, seq_sum_k1 and seq_max_k2)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.corrections as rc
from megarl.batch import unpack
from megarl.objectives.corrections import CORRECTIONS, REJECTIONS
from tests.property.test_advantages import reward_batches

NEW = ("seq_tis", *REJECTIONS)


@settings(max_examples=15, deadline=None)
@given(reward_batches(), st.sampled_from(NEW), st.sampled_from([0.05, 0.3, 1.25, 2.0]), st.floats(0.05, 1.0))
def test_matches_reference(b, name, cap, spread):
    g = torch.Generator().manual_seed(int(b.tokens.sum()))
    old = -torch.rand(b.num_tokens, generator=g, dtype=torch.float64) * 3
    roll = old + spread * torch.randn(b.num_tokens, generator=g, dtype=torch.float64)
    got = CORRECTIONS.get(name)(old, roll, b.loss_mask, b.cu_seqlens, 0.5, cap)
    pad = unpack(b)
    am = pad.attention_mask
    po, pr = torch.zeros(am.shape, dtype=torch.float64), torch.zeros(am.shape, dtype=torch.float64)
    po[am], pr[am] = old, roll
    m = pad.loss_mask.double()
    want = rc.seq_tis(po, pr, m, cap) if name == "seq_tis" else rc.rejection(name, po, pr, m, cap)
    on = b.loss_mask.bool()  # off the loss mask the policy loss is 0 whatever c is
    torch.testing.assert_close(got[on], want[am][on], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", NEW)
def test_without_a_trigger(name):
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(9, generator=g, dtype=torch.float64)
    roll = old - 0.01 * torch.randn(9, generator=g, dtype=torch.float64)
    cu, mask = torch.tensor([0, 4, 9]), torch.ones(9, dtype=torch.float64)
    c = CORRECTIONS.get(name)(old, roll, mask, cu, 0.5, 2.0)
    w = torch.exp(old - roll)
    if name == "seq_tis":  # sequence-level IS: the product of the token weights of each sequence
        w = torch.cat([w[:4].prod().expand(4), w[4:].prod().expand(5)])
    torch.testing.assert_close(c, w)
    # a far-off token (w = e^12) trips every criterion: its sequence (or itself) is dropped / capped
    roll2 = roll.clone()
    roll2[2] = old[2] - 12.0
    c2 = CORRECTIONS.get(name)(old, roll2, mask, cu, 0.5, 2.0)
    assert float(c2[2]) <= 2.0 and torch.equal(c2[4:], c[4:])
