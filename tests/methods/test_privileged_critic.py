"""The privileged critic's batch: each sequence becomes prompt + context + response, packed, with
prompts and contexts of different lengths; every policy token maps to the same token in it, the
loss mask and the critic's fields move with their tokens, and a value read at a response token is
the value of a state that includes the context. The context rows come from the round's answers."""

import asyncio
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.data.tokenizer import CharTokenizer
from megarl.methods.critics.privileged import (
    CONTEXT,
    ContextKnobs,
    CriticContext,
    context_rows,
    privileged_batch,
)
from megarl.plugin.knobs import build_knobs
from megarl.plugin.rounds import RolloutRound
from tests.property.strategies import build_batch, packed_structure


@st.composite
def batches_with_context(draw):
    prompt, resp, gids, holes = draw(packed_structure(max_groups=4))
    rng = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    b = build_batch(prompt, resp, gids, holes, 50, rng, torch.float64)
    b.values = torch.randn(b.num_tokens, generator=rng, dtype=torch.float64)
    b.returns = torch.randn(b.num_tokens, generator=rng, dtype=torch.float64)
    lens = draw(st.lists(st.integers(0, 4), min_size=b.num_seqs, max_size=b.num_seqs))
    ctx = torch.full((b.num_seqs, 4), math.nan, dtype=torch.float64)
    for i, k in enumerate(lens):
        ctx[i, :k] = torch.randint(50, 60, (k,), generator=rng).double()  # ids the batch does not use
    return b, ctx, lens


def _prefix_state(b):
    """A stand-in value of the state before each token: the sum of the sequence's earlier tokens."""
    out = torch.zeros(b.num_tokens, dtype=torch.float64)
    cu = b.cu_seqlens.tolist()
    for i in range(b.num_seqs):
        toks = b.tokens[cu[i] : cu[i + 1]].double()
        out[cu[i] : cu[i + 1]] = torch.cumsum(toks, 0) - toks
    return out


@settings(max_examples=60)
@given(batches_with_context())
def test_sequences_are_prompt_context_response_and_tokens_map_back(case):
    b, ctx, lens = case
    cb, index = privileged_batch(b, ctx)
    cu, ccu = b.cu_seqlens.tolist(), cb.cu_seqlens.tolist()
    for i in range(b.num_seqs):
        p = int(b.prompt_lens[i])
        seq = b.tokens[cu[i] : cu[i + 1]].tolist()
        want = seq[:p] + [int(x) for x in ctx[i, : lens[i]]] + seq[p:]
        assert cb.tokens[ccu[i] : ccu[i + 1]].tolist() == want
        assert int(cb.prompt_lens[i]) == p + lens[i]
    assert torch.equal(cb.tokens[index], b.tokens)
    on_context = torch.ones(cb.num_tokens, dtype=torch.bool)
    on_context[index] = False
    assert int(on_context.sum()) == sum(lens)
    for name in ("loss_mask", "values", "returns"):
        x, y = getattr(b, name), getattr(cb, name)
        assert torch.equal(y[index], x) and bool((y[on_context] == 0).all())
    assert torch.equal(cb.group_ids, b.group_ids)
    # a response token's state in the critic's sequence includes its context
    state = _prefix_state(cb)[index]
    direct = _prefix_state(b)
    resp = b.loss_mask.bool()
    seq_of = torch.repeat_interleave(torch.arange(b.num_seqs), b.seq_lens)
    extra = torch.nan_to_num(ctx, nan=0.0).sum(1)[seq_of]
    torch.testing.assert_close(state[resp], (direct + extra)[resp])
    # sequences keep their order: a data-parallel share of the critic batch is the share's own
    ids = list(range(0, b.num_seqs, 2))
    part, _ = privileged_batch(b.select(ids), ctx[ids])
    sel = cb.select(ids)
    assert torch.equal(part.tokens, sel.tokens) and torch.equal(part.cu_seqlens, sel.cu_seqlens)
    assert torch.equal(part.loss_mask, sel.loss_mask) and torch.equal(part.returns, sel.returns)


def test_context_rows_come_from_each_prompts_answer():
    tok = CharTokenizer("0123456789+=RC ")
    r = RolloutRound(
        prompts=["R123=", "R45="],
        answers=["321", "54"],
        uids=[7, 8],
        prompt_ids=[tok.encode("R123="), tok.encode("R45=")],
        response_ids=[[1], [2], [3], [4]],
        texts=["", "", "", ""],
        dims={},
        scalar=torch.zeros(4),
        n=2,
        step=1,
        round=0,
    )
    knobs = build_knobs(ContextKnobs, {"template": "={answer}", "max_tokens": 5}, "inputs.critic_context")
    res = asyncio.run(CriticContext(tok, knobs).process(r))
    rows = torch.tensor(res.extras[CONTEXT], dtype=torch.float64)
    assert rows.shape == (4, 5)
    want0, want1 = tok.encode("=321", bos=False), tok.encode("=54", bos=False)
    for i, want in enumerate([want0, want0, want1, want1]):  # the same context for a prompt's samples
        assert rows[i, : len(want)].tolist() == want and bool(rows[i, len(want) :].isnan().all())
    assert res.metrics["critic/context_len"] == 3.5
    small = build_knobs(ContextKnobs, {"max_tokens": 2}, "inputs.critic_context")
    with pytest.raises(ValueError, match=r"inputs.critic_context: the context of prompt 7 has 3 tokens"):
        asyncio.run(CriticContext(tok, small).process(r))


def test_bad_knobs_and_missing_rows_are_named():
    with pytest.raises(ValueError, match="inputs.critic_context: template"):
        build_knobs(ContextKnobs, {"template": "{question}"}, "inputs.critic_context")
    with pytest.raises(ValueError, match="inputs.critic_context: max_tokens"):
        build_knobs(ContextKnobs, {"max_tokens": 0}, "inputs.critic_context")
    b = build_batch([2], [3], [0], [False] * 3, 8, torch.Generator().manual_seed(0), torch.float64)
    with pytest.raises(ValueError, match="critic_context"):
        context_rows(b)
    with pytest.raises(ValueError, match=r"expected \[num_seqs=1, K\]"):
        privileged_batch(b, torch.zeros(2, 3))
