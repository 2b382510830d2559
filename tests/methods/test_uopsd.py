"""U-OPSD: megarl (routes prepared per DP shard, TP 1/2, DP 1/2, micro-batched) equals
reference/self_distillation.py:uopsd_loss in loss and gradient; the self-teacher's context follows
the reference selection (shortest majority rollout teaches the longest dissenting one, ties by
index, skipped under min_vote or without dissent); the spec's invariants: no label enters the loss,
skipped groups give zero loss, teacher = student gives zero loss, the teacher gets no gradient."""

import asyncio
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.self_distillation as ref
from megarl.batch import from_sequences
from megarl.data.tokenizer import CharTokenizer
from megarl.methods.distillation.routes import set_routes
from megarl.methods.distillation.self_teacher import (
    CONTEXT,
    CORRECT,
    ContextKnobs,
    SelfTeacher,
    SelfTeacherContext,
    TeacherKnobs,
)
from megarl.methods.distillation.uopsd import SPEC, uopsd_rule
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective
from megarl.plugin.knobs import build_knobs
from megarl.plugin.rounds import RolloutRound
from megarl.testing.equivalence import split_sequences
from tests.methods.helpers import load_example
from tests.methods.test_self_teacher import TinyCausalLM, V
from tests.methods.trust_regions_harness import (
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    reference_method_loss_and_grad,
)
from tests.property.strategies import build_batch, rl_cases

AGGS = ("seq-mean-token-mean", "token-mean")
CFGS = st.builds(
    lambda agg, frontier: ObjectiveConfig(
        policy_loss="uopsd", aggregation=agg, policy_loss_args={"aggregation": agg, "frontier": frontier}
    ),
    st.sampled_from(AGGS),
    st.booleans(),
)


def _set_up(case, data, dp):
    """Per group at most one target (a context row), majority-agreement bits; groups never straddle DP."""
    b = case.batch
    side = torch.zeros(b.num_seqs, dtype=torch.long)
    for r, ids in enumerate(split_sequences(b.num_seqs, dp)):
        side[ids] = r
    b.group_ids = b.group_ids * dp + side
    agree = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b.num_seqs, max_size=b.num_seqs)))
    target = torch.zeros(b.num_seqs, dtype=torch.bool)
    for g in torch.unique(b.group_ids):
        members = (b.group_ids == g).nonzero()[:, 0].tolist()
        pick = data.draw(st.sampled_from([None, *members]))
        if pick is not None:
            target[pick] = True
    rows = torch.full((b.num_seqs, 3), math.nan, dtype=torch.float64)
    rows[target, 0] = 1.0
    b.self_teacher_logprobs = b.teacher_logprobs
    b.extras = {CONTEXT: rows, CORRECT: agree.double()}
    d = uopsd_rule(b)
    set_routes(b, d.routes, d.active)
    share = torch.tensor(
        [float(agree[b.group_ids == g].double().mean()) for g in b.group_ids], dtype=torch.float64
    )
    return target, share


@settings(max_examples=5, deadline=None)
@given(
    case=rl_cases(torch.float64, cfgs=CFGS),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
    data=st.data(),
)
def test_matches_reference(case, tp, dp, mb, data):
    target, share = _set_up(case, data, dp)
    args = case.cfg.policy_loss_args

    def fn(full, pad):
        _, old, _, mask = padded_inputs(full, pad)
        t = pad.per_token["self_teacher_logprobs"]
        return ref.uopsd_loss(
            full, pad.tokens, mask, old, t, target, share, args["frontier"], args["aggregation"]
        )

    assert_equivalent(
        megarl_method_loss_and_grad(case, tp, dp, mb), reference_method_loss_and_grad(case, fn), case.logits
    )


VOCAB = st.builds(
    lambda agg, frontier, direction, top_k: ObjectiveConfig(
        policy_loss="uopsd",
        aggregation=agg,
        policy_loss_args={"aggregation": agg, "frontier": frontier, "sd_coef": 0.0},
        regularisers=[
            {
                "name": "uopsd_kl",
                "coef": 1.0,
                "aggregation": agg,
                "frontier": frontier,
                "direction": direction,
                "top_k": top_k,
            }
        ],
    ),
    st.sampled_from(AGGS),
    st.booleans(),
    st.sampled_from(["reverse", "forward"]),
    st.sampled_from([0, 1, 3]),
)


@settings(max_examples=6, deadline=None)
@given(
    case=rl_cases(torch.float64, cfgs=VOCAB, vocab_sizes=(4, 8, 12)),
    layout=st.sampled_from([(1, 1, 1), (2, 2, 2), (2, 1, 3), (1, 2, 1)]),
    data=st.data(),
)
def test_vocabulary_and_topk_distillation_match_reference(case, layout, data):
    """uopsd_kl (full vocabulary, top-1, top-3; both directions) equals reference uopsd_vocab_loss
    in loss and logits gradient at TP 1/2, DP 1/2, 1-3 micro-batches."""
    tp, dp, mb = layout
    target, share = _set_up(case, data, dp)
    reg = case.cfg.regularisers[0]

    def fn(full, pad):
        _, _, _, mask = padded_inputs(full, pad)
        teacher = torch.zeros_like(full, requires_grad=False)
        teacher[pad.attention_mask] = case.teacher_logits
        return ref.uopsd_vocab_loss(
            full,
            teacher,
            mask,
            target,
            share,
            reg["frontier"],
            reg["aggregation"],
            reg["direction"],
            reg["top_k"],
        )

    mb = min(mb, -(-case.batch.num_seqs // dp))
    assert_equivalent(
        megarl_method_loss_and_grad(case, tp, dp, mb), reference_method_loss_and_grad(case, fn), case.logits
    )


def test_topk_with_every_id_is_the_full_vocabulary_kl():
    """token_divergence: the top-V restriction equals the full-vocabulary KL (both directions), at
    TP 1 here and TP 2 in the equivalence test above."""
    from megarl.methods.distillation.vocab_divergence import token_divergence

    g = torch.Generator().manual_seed(0)
    s, t = (torch.randn(6, 7, generator=g, dtype=torch.float64) * 2 for _ in range(2))
    for d in ("forward", "reverse"):
        full = token_divergence(s, t, d, 0)
        assert torch.allclose(token_divergence(s, t, d, 7), full, atol=1e-12)
        assert torch.allclose(full, ref.token_divergence(s, t, d, 0), atol=1e-12)
        assert bool((token_divergence(s, t, d, 3) >= -1e-12).all())
    assert float(token_divergence(s, s, "reverse", 3).abs().max()) < 1e-12


TOK = CharTokenizer("0123456789+=RC ")


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["1", "2", "3"]), st.integers(0, 3)), min_size=2, max_size=6),
    st.sampled_from([0.0, 0.34, 0.5, 0.8]),
)
def test_context_follows_the_reference_selection(samples, min_vote):
    texts = [a + " " * pad for a, pad in samples]  # the answer is the stripped text; lengths differ
    n = len(texts)
    r = RolloutRound(
        prompts=["R 1="],
        answers=["9"],  # never read
        uids=[0],
        prompt_ids=[TOK.encode("R 1=")],
        response_ids=[TOK.encode(t, bos=False) for t in texts],
        texts=texts,
        dims={},
        scalar=torch.zeros(n),
        n=n,
        step=1,
        round=0,
    )
    knobs = {
        "source": "majority",
        "when": "longest_incorrect",
        "min_vote": min_vote,
        "template": "{solution}",
    }
    res = asyncio.run(SelfTeacherContext(TOK, build_knobs(ContextKnobs, knobs, "inputs.x")).process(r))
    s, w, share = ref.uopsd_select([a for a, _ in samples], [len(t) for t in texts], min_vote)
    rows = torch.as_tensor(res.extras[CONTEXT])
    has = ~rows.isnan().all(1)
    if w is None:
        assert not bool(has.any())
    else:
        assert has.nonzero()[:, 0].tolist() == [w]
        assert TOK.decode([int(x) for x in rows[w] if not math.isnan(x)]) == texts[s]
    assert sum(res.extras[CORRECT]) / n == share


def _loss_and_grad(b, logits, frontier=False):
    cfg = ObjectiveConfig("uopsd", aggregation="seq-mean-token-mean", policy_loss_args={"frontier": frontier})
    obj = build_objective(cfg)
    b = obj.prepare(b)
    x = logits.clone().requires_grad_(True)
    out = obj(x, b, LossContext(GlobalNormalisers.from_batch(b)))
    out.loss.backward()
    return out.loss.detach(), x.grad


def _batch(targets, seed=0, V=7):
    g = torch.Generator().manual_seed(seed)
    n = len(targets)
    b = from_sequences([[1, 2]] * n, [[3, 4, 5][: 1 + i % 3] for i in range(n)], [i // 2 for i in range(n)])
    logits = torch.randn(b.num_tokens, V, generator=g, dtype=torch.float64)
    b.old_logprobs = torch.log_softmax(logits, -1)[torch.arange(b.num_tokens), b.tokens]
    b.self_teacher_logprobs = (
        b.old_logprobs - torch.rand(b.num_tokens, generator=g, dtype=torch.float64)
    ).clamp(max=0)
    b.rewards = torch.randn(n, generator=g, dtype=torch.float64)
    b.advantages = torch.randn(b.num_tokens, generator=g, dtype=torch.float64) * b.loss_mask
    rows = torch.full((n, 2), math.nan, dtype=torch.float64)
    rows[torch.tensor(targets), 0] = 3.0
    b.extras = {CONTEXT: rows, CORRECT: (~torch.tensor(targets)).double()}
    d = uopsd_rule(b)
    set_routes(b, d.routes, d.active)
    return b, logits


def test_no_label_enters_the_loss_and_skipped_groups_give_zero():
    b, logits = _batch([False, True, False, False])
    loss, grad = _loss_and_grad(b, logits)
    assert float(loss) != 0.0 and bool(grad[b.cu_seqlens[1] : b.cu_seqlens[2]].abs().sum() > 0)
    assert bool((grad[: b.cu_seqlens[1]] == 0).all()) and bool((grad[b.cu_seqlens[2] :] == 0).all())
    b.rewards, b.advantages = -b.rewards, -3 * b.advantages  # poisoned labels
    assert torch.equal(_loss_and_grad(b, logits)[0], loss)
    b, logits = _batch([False, False, False, False])
    loss, grad = _loss_and_grad(b, logits)
    assert float(loss) == 0.0 and bool((grad == 0).all())


def test_vocab_term_without_a_target_needs_no_teacher_logits():
    """A batch whose groups all skip has no privileged forward (no self_teacher_logits): uopsd_kl
    gives zero there; with a target and no logits it refuses, naming the input."""
    reg = {"name": "uopsd_kl", "coef": 1.0, "aggregation": "seq-mean-token-mean", "top_k": 2}
    cfg = ObjectiveConfig(
        "uopsd",
        aggregation="seq-mean-token-mean",
        policy_loss_args={"sd_coef": 0.0},
        regularisers=[reg],
    )
    for targets in ([False] * 4, [False, True, False, False]):
        b, logits = _batch(targets)
        obj = build_objective(cfg)
        b = obj.prepare(b)
        x = logits.clone().requires_grad_(True)
        if any(targets):
            with pytest.raises(ValueError, match="self_teacher_logits"):
                obj(x, b, LossContext(GlobalNormalisers.from_batch(b)))
            continue
        out = obj(x, b, LossContext(GlobalNormalisers.from_batch(b)))
        out.loss.backward()
        assert float(out.loss.detach()) == 0.0 and float(out.metrics["reg/uopsd_kl"]) == 0.0
        assert x.grad is not None and bool((x.grad == 0).all())


def test_teacher_equal_to_student_gives_zero_and_the_teacher_gets_no_gradient():
    b, logits = _batch([True, False, False, True])
    b.self_teacher_logprobs = b.old_logprobs.clone()
    loss, grad = _loss_and_grad(b, logits, frontier=True)
    assert float(loss) == 0.0 and bool((grad == 0).all())
    b.self_teacher_logprobs = (b.old_logprobs - 0.7).requires_grad_(True)
    loss, _ = _loss_and_grad(b, logits)
    assert float(loss) > 0 and b.self_teacher_logprobs.grad is None


def test_example_and_spec():
    cfg = load_example("uopsd")
    assert cfg["method"]["name"] == "uopsd" and cfg["inputs"]["self_teacher_context"]["source"] == "majority"
    assert SPEC.config["inputs"]["routes"]["rule"] == "uopsd"


@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["1", "2"]), st.integers(0, 3)), min_size=2, max_size=6),
    st.sampled_from([0.0, 0.5]),
    st.sampled_from([2, 3]),
)
def test_several_solutions_follow_the_reference_selection(samples, min_vote, m):
    """solutions: m: the target's row holds the m shortest majority rollouts, one block each,
    shortest first (reference uopsd_select_many); other samples have none."""
    texts = [a + " " * pad for a, pad in samples]
    n = len(texts)
    r = RolloutRound(
        prompts=["R 1="],
        answers=["9"],
        uids=[0],
        prompt_ids=[TOK.encode("R 1=")],
        response_ids=[TOK.encode(t, bos=False) for t in texts],
        texts=texts,
        dims={},
        scalar=torch.zeros(n),
        n=n,
        step=1,
        round=0,
    )
    knobs = {"source": "majority", "when": "longest_incorrect", "min_vote": min_vote, "solutions": m}
    res = asyncio.run(SelfTeacherContext(TOK, build_knobs(ContextKnobs, knobs, "inputs.x")).process(r))
    teachers, w, _ = ref.uopsd_select_many([a for a, _ in samples], [len(t) for t in texts], min_vote, m)
    rows = torch.as_tensor(res.extras[CONTEXT])
    assert rows.shape == (n, 64 * m) and res.extras["self_teacher_blocks"] == [float(m)] * n
    for i in range(n):
        blocks = rows[i].split(64)
        got = [TOK.decode([int(x) for x in b if not math.isnan(x)]) for b in blocks]
        want = [texts[j] for j in teachers] if i == w else []
        assert [g for g in got if g] == want and all(not g for g in got[len(want) :])


def test_the_teacher_is_the_mixture_of_the_solutions_read():
    """Two blocks: the self-teacher's logprob of every response token is log of the mean of the
    two self-conditioned probabilities (reference mixture_logprobs), one where only one solution
    exists, 0 and off without any; its full distribution (self_teacher_logits) is the mixture of
    the two self-conditioned distributions, consistent with the logprobs at the sampled tokens."""

    b = build_batch(
        [3, 2, 4], [4, 5, 2], [0, 0, 1], [False] * 11, V, torch.Generator().manual_seed(3), torch.float64
    )
    rows = torch.full((3, 6), math.nan, dtype=torch.float64)
    rows[0, :2], rows[0, 3:6] = torch.tensor([4.0, 7.0]), torch.tensor([1.0, 2.0, 3.0])
    rows[2, 3:5] = torch.tensor([5.0, 6.0])  # only the second block
    b.extras.update({CONTEXT: rows, "self_teacher_blocks": torch.full((3,), 2.0, dtype=torch.float64)})
    model = TinyCausalLM(1)
    SelfTeacher(model, TeacherKnobs()).fill(b, 2)
    cu = b.cu_seqlens.tolist()

    def conditioned(i, ctx):
        p, seq = int(b.prompt_lens[i]), b.tokens[cu[i] : cu[i + 1]].tolist()
        full = model.logprobs(seq[:p] + ctx + seq[p:])
        return torch.cat([full[:p], full[p + len(ctx) :]])

    want0 = ref.mixture_logprobs(torch.stack([conditioned(0, [4, 7]), conditioned(0, [1, 2, 3])]))
    torch.testing.assert_close(b.self_teacher_logprobs[cu[0] : cu[1]], want0.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        b.self_teacher_logprobs[cu[2] : cu[3]], conditioned(2, [5, 6]).float(), rtol=0, atol=1e-6
    )
    assert bool((b.self_teacher_logprobs[cu[1] : cu[2]] == 0).all())
    assert b.extras["self_teacher_on"].tolist() == [1.0, 0.0, 1.0]
    # the full distributions (self_teacher_logits, for uopsd_kl): the mixture's log-probabilities
    b.extras.pop("self_teacher_on")
    SelfTeacher(model, TeacherKnobs(), frozenset({"self_teacher_logprobs", "self_teacher_logits"})).fill(b, 2)
    mix = b.token_extras.pop("teacher_logits")

    def conditioned_logits(i, ctx):
        p, seq = int(b.prompt_lens[i]), b.tokens[cu[i] : cu[i + 1]].tolist()
        return torch.log_softmax(model.logits(seq[:p] + ctx + seq[p:])[p + len(ctx) :], -1)

    p0, p2 = int(b.prompt_lens[0]), int(b.prompt_lens[2])
    want = ref.mixture_logprobs(
        torch.stack([conditioned_logits(0, [4, 7]), conditioned_logits(0, [1, 2, 3])])
    )
    torch.testing.assert_close(mix[cu[0] + p0 : cu[1]], want, rtol=0, atol=1e-9)
    torch.testing.assert_close(mix[cu[2] + p2 : cu[3]], conditioned_logits(2, [5, 6]), rtol=0, atol=1e-9)
    assert bool((mix[cu[1] : cu[2]] == 0).all())
    toks = b.tokens[cu[0] + p0 : cu[1]]
    at = mix[cu[0] + p0 : cu[1]].gather(-1, toks[:, None])[:, 0]  # the sampled tokens: the logprobs above
    torch.testing.assert_close(at.float(), b.self_teacher_logprobs[cu[0] + p0 : cu[1]], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="solutions=2"):
        SelfTeacher(model, TeacherKnobs(forward="all")).fill(b, 1)
    with pytest.raises(ValueError, match="solutions=2: >= 1, and > 1 only with source sibling or majority"):
        ContextKnobs(source="answer", solutions=2).check()
