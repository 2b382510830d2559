"""The self-teacher: the policy's own forward over prompt + privileged context + response, mapped
back to the batch's tokens. With empty contexts it gives the policy's logprobs exactly; with
contexts it gives what a plain forward of the concatenated sequence gives (a tiny causal LM in
PyTorch, float64). The round input picks contexts by source (answer, correct sibling, majority
vote) and by ``when``; the majority source reads no ground truth."""

import asyncio
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.data.tokenizer import CharTokenizer
from megarl.methods.distillation.self_teacher import (
    CONTEXT,
    CORRECT,
    ContextKnobs,
    SelfTeacher,
    SelfTeacherContext,
    TeacherKnobs,
    choose_contexts,
    majority_vote,
)
from megarl.plugin.knobs import build_knobs
from megarl.plugin.rounds import RolloutRound
from tests.property.strategies import build_batch, packed_structure

V = 12


class TinyCausalLM(torch.nn.Module):
    """Embedding + one causal attention layer + head (float64): a real forward, position-aware."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(V, 16, dtype=torch.float64)
        self.pos = torch.nn.Embedding(64, 16, dtype=torch.float64)
        self.att = torch.nn.MultiheadAttention(16, 2, batch_first=True, dtype=torch.float64)
        self.head = torch.nn.Linear(16, V, dtype=torch.float64)

    @torch.no_grad()
    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        """log p(tokens[t] | tokens[<t]) for t >= 1, 0 at t = 0 (the batch convention)."""
        x = torch.tensor(tokens)[None]
        h = self.emb(x) + self.pos(torch.arange(x.shape[1]))[None]
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        h = h + self.att(h, h, h, attn_mask=causal)[0]
        lp = torch.log_softmax(self.head(h)[0], -1)
        out = torch.zeros(len(tokens), dtype=torch.float64)
        out[1:] = lp[:-1].gather(-1, x[0, 1:, None])[:, 0]
        return out

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Aligned logits [L, V]: row t scored tokens[t] (row 0: the first position's own)."""
        x = torch.tensor(tokens)[None]
        h = self.emb(x) + self.pos(torch.arange(x.shape[1]))[None]
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        z = self.head(h + self.att(h, h, h, attn_mask=causal)[0])[0]
        return torch.cat([z[:1], z[:-1]])

    def compute_logits(self, batch, micro_batches: int = 1):
        """The learner's contract: aligned logits [T, V] of a packed batch."""
        cu = batch.cu_seqlens.tolist()
        return torch.cat([self.logits(batch.tokens[a:b].tolist()) for a, b in itertools.pairwise(cu)])

    def compute_logprobs(self, batch, micro_batches: int = 1):
        """The learner's contract: logprobs [T] of a packed batch (micro-batches hold whole sequences)."""
        assert 1 <= micro_batches <= batch.num_seqs
        cu = batch.cu_seqlens.tolist()
        return torch.cat([self.logprobs(batch.tokens[a:b].tolist()) for a, b in itertools.pairwise(cu)]), None


@st.composite
def batches_with_context(draw):
    prompt, resp, gids, holes = draw(packed_structure(max_groups=3))
    rng = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    b = build_batch(prompt, resp, gids, holes, V, rng, torch.float64)
    lens = draw(st.lists(st.integers(0, 4), min_size=b.num_seqs, max_size=b.num_seqs))
    rows = torch.full((b.num_seqs, 4), math.nan, dtype=torch.float64)
    for i, k in enumerate(lens):
        rows[i, :k] = torch.randint(0, V, (k,), generator=rng).double()
    return b, rows, lens


@settings(max_examples=15, deadline=None)
@given(batches_with_context(), st.sampled_from([1, 2]), st.sampled_from(["with_context", "all"]))
def test_logprobs_equal_a_plain_forward_of_the_concatenated_sequence(case, micro, forward):
    b, rows, lens = case
    model = TinyCausalLM()
    b.extras[CONTEXT] = rows
    SelfTeacher(model, TeacherKnobs(forward=forward)).fill(b, micro)
    cu = b.cu_seqlens.tolist()
    student, _ = model.compute_logprobs(b)
    for i in range(b.num_seqs):
        p, seq = int(b.prompt_lens[i]), b.tokens[cu[i] : cu[i + 1]].tolist()
        ctx = [int(x) for x in rows[i, : lens[i]]]
        got = b.self_teacher_logprobs[cu[i] : cu[i + 1]]
        if forward == "with_context" and not ctx:
            assert b.extras["self_teacher_on"][i] == 0 and bool((got == 0).all())
            continue
        full = model.logprobs(seq[:p] + ctx + seq[p:])
        want = torch.cat([full[:p], full[p + len(ctx) :]])  # the context's own positions dropped
        torch.testing.assert_close(got, want.float(), rtol=0, atol=0)
        resp = b.loss_mask[cu[i] : cu[i + 1]].bool()
        if ctx and resp.any():  # the context changes the response's logprobs
            assert not torch.equal(got[resp], student[cu[i] : cu[i + 1]][resp].float())


def test_logits_are_the_concatenated_sequences_at_the_batchs_tokens():
    b = build_batch(
        [3, 2, 4], [4, 5, 2], [0, 0, 1], [False] * 11, V, torch.Generator().manual_seed(5), torch.float64
    )
    model = TinyCausalLM(2)
    rows = torch.full((3, 3), math.nan, dtype=torch.float64)
    rows[0, :2] = torch.tensor([4.0, 7.0])
    rows[2, :3] = torch.tensor([1.0, 2.0, 3.0])
    b.extras[CONTEXT] = rows
    SelfTeacher(model, TeacherKnobs(), frozenset({"self_teacher_logprobs", "self_teacher_logits"})).fill(b, 2)
    got = b.token_extras["teacher_logits"]
    cu = b.cu_seqlens.tolist()
    for i, k in ((0, 2), (2, 3)):
        p, seq = int(b.prompt_lens[i]), b.tokens[cu[i] : cu[i + 1]].tolist()
        full = model.logits(seq[:p] + [int(x) for x in rows[i, :k]] + seq[p:])
        torch.testing.assert_close(got[cu[i] + p : cu[i + 1]], full[p + k :], rtol=0, atol=0)
        lp = torch.log_softmax(got[cu[i] + p : cu[i + 1]], -1).gather(-1, torch.tensor(seq[p:])[:, None])[
            :, 0
        ]
        torch.testing.assert_close(lp.float(), b.self_teacher_logprobs[cu[i] + p : cu[i + 1]])
    assert bool((got[cu[1] : cu[2]] == 0).all())  # not forwarded
    with pytest.raises(ValueError, match="already carries a teacher's logits"):
        SelfTeacher(model, TeacherKnobs(), frozenset({"self_teacher_logits"})).fill(b, 1)


def test_empty_contexts_give_the_policys_logprobs_exactly():
    b = build_batch(
        [3, 2, 4], [4, 5, 2], [0, 0, 1], [False] * 11, V, torch.Generator().manual_seed(3), torch.float64
    )
    model = TinyCausalLM(1)
    b.extras[CONTEXT] = torch.full((3, 5), math.nan, dtype=torch.float64)
    m = SelfTeacher(model, TeacherKnobs(forward="all")).fill(b, 2)
    assert torch.equal(b.self_teacher_logprobs, model.compute_logprobs(b)[0].float())
    assert m == {"self_teacher/forwarded_frac": 1.0}
    b.self_teacher_logprobs = None
    assert SelfTeacher(model, TeacherKnobs()).fill(b, 2) == {"self_teacher/forwarded_frac": 0.0}
    assert torch.equal(b.self_teacher_logprobs, torch.zeros(b.num_tokens))


TOK = CharTokenizer("0123456789+=RC ")


def _round(texts, correct, answers=("321", "54"), n=4):
    return RolloutRound(
        prompts=["R123=", "R45="][: len(answers)],
        answers=list(answers),
        uids=[7, 8][: len(answers)],
        prompt_ids=[TOK.encode("R123="), TOK.encode("R45=")][: len(answers)],
        response_ids=[TOK.encode(t, bos=False) for t in texts],
        texts=list(texts),
        dims={},
        scalar=torch.zeros(len(texts)),
        n=n,
        step=1,
        round=0,
        correct=None if correct is None else torch.tensor(correct),
    )


def _rows(res):
    rows = torch.as_tensor(res.extras[CONTEXT], dtype=torch.float64)
    return [
        TOK.decode([int(x) for x in r if not math.isnan(x)]) if not r.isnan().all() else None for r in rows
    ]


def _process(knobs, r):
    return asyncio.run(
        SelfTeacherContext(TOK, build_knobs(ContextKnobs, knobs, "inputs.self_teacher_context")).process(r)
    )


def test_sources_and_when_choose_the_documented_contexts():
    texts = ["321", "3210", "12", "321", "5", "55", "555", "5555"]
    correct = [True, False, False, True, False, False, False, False]
    r = _round(texts, correct)
    res = _process({"source": "answer", "template": "={solution}", "when": "group_all_wrong"}, r)
    assert _rows(res) == [None] * 4 + ["=54"] * 4 and res.extras[CORRECT] == [float(c) for c in correct]
    # sibling: the shortest correct other than the sample itself (ties: the lowest index)
    res = _process({"source": "sibling", "when": "all"}, r)
    assert _rows(res) == ["321", "321", "321", "321", None, None, None, None]
    assert res.metrics["self_teacher/context_frac"] == 0.5
    res = _process({"source": "sibling", "when": "longest_incorrect"}, r)
    assert _rows(res) == [None, "321", None, None, None, None, None, None]


def test_majority_vote_reads_no_ground_truth():
    texts = ["12", "12", "123", "9", "5", "6", "7", "8"]
    knobs = {"source": "majority", "when": "longest_incorrect", "min_vote": 0.5}
    res = _process(knobs, _round(texts, None))
    # group 0: "12" has 2/4 votes; the longest disagreeing sample (2) learns from the shortest agreeing
    assert _rows(res) == [None, None, "12", None] + [None] * 4  # group 1: 1/4 votes < 0.5: nothing
    assert res.extras[CORRECT] == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    poisoned = _process(knobs, _round(texts, [True] * 8, answers=("999", "000")))
    assert poisoned.extras == res.extras
    assert majority_vote(["a", "b", None, "b"], 0.5) == ([False, True, False, True], True)
    assert majority_vote([None, None], 0.1) == ([False, False], False)
    assert choose_contexts([3, 1, 2], [True, True, False], "majority", "incorrect") == [None, None, 1]


def test_bad_knobs_and_missing_inputs_are_named():
    for knobs, msg in [
        ({"source": "oracle"}, "source='oracle'"),
        ({"when": "sometimes"}, "when='sometimes'"),
        ({"template": "{question}"}, "template="),
        ({"source": "majority", "template": "{answer}"}, "template: source=majority reads no ground truth"),
        ({"answer_pattern": "("}, "answer_pattern"),
        ({"min_vote": 1.5}, "min_vote"),
    ]:
        with pytest.raises(ValueError, match=f"inputs.self_teacher_context: {msg}"):
            build_knobs(ContextKnobs, knobs, "inputs.self_teacher_context")
    with pytest.raises(ValueError, match=r"reward.functions\[i\].correct"):
        _process({"source": "sibling"}, _round(["1"] * 8, None))
    with pytest.raises(ValueError, match="of sample 0 of prompt 7 has 3 tokens, more than max_tokens=2"):
        _process({"max_tokens": 2}, _round(["1"] * 8, [True] * 8))
    b = build_batch([2], [3], [0], [False] * 3, V, torch.Generator().manual_seed(0), torch.float64)
    with pytest.raises(ValueError, match="self_teacher_context round input fills them"):
        SelfTeacher(TinyCausalLM(), TeacherKnobs()).fill(b, 1)
