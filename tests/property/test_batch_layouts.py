"""Packed <-> padded round trips and micro-batch splits of the batch schema."""

import dataclasses

import torch
from hypothesis import given
from hypothesis import strategies as st

from megarl.batch import TOKEN_FIELDS, PackedBatch, pack, unpack
from tests.property.strategies import build_batch, packed_structure


@st.composite
def full_batches(draw):
    prompt, resp, gids, holes = draw(packed_structure())
    rng = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    b = build_batch(prompt, resp, gids, holes, 16, rng, torch.float32)
    for name in TOKEN_FIELDS:
        x = torch.randn(b.num_tokens, generator=rng)
        setattr(b, name, -x.abs() if name.endswith("logprobs") else x)
    B = b.num_seqs
    b.rewards = torch.randn(B, 3, generator=rng)
    b.reward_names = ["a", "b", "c"]
    b.task_ids = torch.randint(0, 4, (B,), generator=rng)
    b.policy_versions = torch.randint(0, 9, (B,), generator=rng)
    b.truncated = torch.rand(B, generator=rng) > 0.5
    b.routed_experts = torch.randint(0, 8, (b.num_tokens, 2, 2), generator=rng)
    b.turn_spans = [[(0, int(n), "assistant")] for n in b.seq_lens]
    return b


def _equal(a: PackedBatch, b: PackedBatch):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
        else:
            assert x == y, f.name


@given(full_batches(), st.integers(0, 3))
def test_pack_unpack_round_trip(b, extra_pad):
    b.validate()
    padded = unpack(b, pad_to=int(b.seq_lens.max()) + extra_pad)
    assert padded.tokens.shape == (b.num_seqs, int(b.seq_lens.max()) + extra_pad)
    assert float(padded.loss_mask[~padded.attention_mask].abs().sum()) == 0
    _equal(pack(padded), b)


@given(full_batches(), st.data())
def test_split_then_concatenate_is_identity(b, data):
    k = data.draw(st.integers(1, b.num_seqs))
    parts = b.split(k)
    assert len(parts) == k and sum(p.num_seqs for p in parts) == b.num_seqs
    assert torch.equal(torch.cat([p.tokens for p in parts]), b.tokens)
    for name in TOKEN_FIELDS:
        assert torch.equal(torch.cat([getattr(p, name) for p in parts]), getattr(b, name))
    _equal(b.select(list(range(b.num_seqs))), b)
