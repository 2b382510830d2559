"""SKALD: megarl (vocab-parallel tilted loss, gate prepared on every DP shard, TP 1/2,
micro-batched) equals reference/distillation.py in loss and gradient, and the spec's invariants:
β = 0 gives the logits gradient p_S − q_T exactly, w_β sums to 1 and vanishes where p_S does,
a closed gate is GRPO exactly, q_T = p_S with β = 0 gives zero gradient, the schedule's endpoints."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.distillation as rd
from megarl.batch import from_sequences
from megarl.methods.distillation.skald import (
    prepare,
    skald_beta,
    tilted_log_weights,
    tilted_loss,
    tilted_topk_loss,
)
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective
from megarl.testing.equivalence import split_sequences
from megarl.testing.simulated_group import SimulatedWorld
from reference.policy_losses import ppo_clip
from tests.methods.helpers import load_example
from tests.methods.trust_regions_harness import (
    aggregate,
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases

KNOBS = st.fixed_dictionaries(
    {
        "beta0": st.sampled_from([0.0, 0.5, 1.0]),
        "gate": st.sampled_from(["zero_variance", "always", "teacher_advantage"]),
        "margin": st.sampled_from([0.0, 0.25]),
    }
)
CFGS = st.builds(
    lambda agg, knobs: ObjectiveConfig(
        policy_loss="ppo", aggregation=agg, regularisers=[{"name": "skald", "coef": 0.5, **knobs}]
    ),
    st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
    KNOBS,
)


def _set_up(case, data, dp):
    b = case.batch
    B = b.num_seqs
    side = torch.zeros(B, dtype=torch.long)
    for r, ids in enumerate(split_sequences(B, dp)):
        side[ids] = r
    b.group_ids = b.group_ids * dp + side
    b.rewards = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=B, max_size=B)))
    acc = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=B, max_size=B))
    b.extras = {"teacher_acc": torch.tensor(acc, dtype=torch.float64)}


def _reference(case):
    reg = case.cfg.regularisers[0]
    b = case.batch
    gate = rd.skald_gate(b.rewards, b.group_ids, reg["gate"], b.extras["teacher_acc"], reg["margin"])

    def fn(full, pad):
        logp, old, adv, _ = padded_inputs(full, pad)
        teacher = torch.zeros_like(full)
        teacher[pad.attention_mask] = case.teacher_logits
        pg = aggregate(ppo_clip(logp, old, adv), pad, case.cfg.aggregation)
        tilted = rd.skald_tilted_loss(full, teacher, rd.skald_beta(0, reg["beta0"], 0)) * gate[:, None]
        return pg + 0.5 * aggregate(tilted, pad, case.cfg.aggregation)

    return reference_method_loss_and_grad(case, fn)


@settings(max_examples=10)
@given(
    case=rl_cases(torch.float64, cfgs=CFGS),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
    data=st.data(),
)
def test_matches_reference(case, tp, dp, mb, data):
    _set_up(case, data, dp)
    mb = min(mb, -(-case.batch.num_seqs // dp))
    assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, mb), _reference(case), case.logits)


TOPK_CFGS = st.builds(
    lambda knobs: ObjectiveConfig(
        policy_loss="ppo",
        aggregation="token-mean",
        regularisers=[{"name": "skald_topk", "coef": 0.5, **knobs}],
    ),
    KNOBS,
)


def _with_topk(case, k):
    """The teacher's top-k ids and logprobs from the case's teacher logits, in token_extras."""
    lt = torch.log_softmax(case.teacher_logits, -1)
    vals, ids = torch.topk(lt, k, -1)
    case.batch.token_extras = {"teacher_topk_ids": ids, "teacher_topk_logprobs": vals}


@settings(max_examples=8)
@given(
    case=rl_cases(torch.float64, cfgs=TOPK_CFGS, vocab_sizes=(8, 12)),
    k=st.sampled_from([1, 3, 8]),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_topk_matches_reference(case, k, tp, dp, data):
    _set_up(case, data, dp)
    _with_topk(case, k)
    reg = case.cfg.regularisers[0]
    b = case.batch
    gate = rd.skald_gate(b.rewards, b.group_ids, reg["gate"], b.extras["teacher_acc"], reg["margin"])

    def fn(full, pad):
        logp, old, adv, _ = padded_inputs(full, pad)
        am = pad.attention_mask
        ids = torch.zeros(am.shape + (k,), dtype=torch.long)
        lq = torch.zeros(am.shape + (k,), dtype=torch.float64)
        ids[am], lq[am] = b.token_extras["teacher_topk_ids"], b.token_extras["teacher_topk_logprobs"]
        pg = aggregate(ppo_clip(logp, old, adv), pad, "token-mean")
        tilted = rd.skald_topk_loss(full, ids, lq, rd.skald_beta(0, reg["beta0"], 0)) * gate[:, None]
        return pg + 0.5 * aggregate(tilted, pad, "token-mean")

    mb = min(2, -(-b.num_seqs // dp))
    assert_equivalent(
        megarl_method_loss_and_grad(case, tp, dp, mb), reference_method_loss_and_grad(case, fn), case.logits
    )


@settings(max_examples=6)
@given(seed=st.integers(0, 1000), tp=st.sampled_from([1, 2]), beta=st.sampled_from([0.0, 0.7]))
def test_topk_with_every_id_is_the_full_vocabulary_loss(seed, tp, beta):
    g = torch.Generator().manual_seed(seed)
    zs, zt = (
        torch.randn(5, 8, generator=g, dtype=torch.float64),
        torch.randn(5, 8, generator=g, dtype=torch.float64),
    )
    vals, ids = torch.topk(torch.log_softmax(zt, -1), 8, -1)

    def both(s, t, grp):
        out = []
        for f in (
            lambda x: tilted_loss(x, t, beta, grp),
            lambda x: tilted_topk_loss(x, ids, vals, beta, grp),
        ):
            x = s.clone().requires_grad_(True)
            v = f(x)
            v.sum().backward()
            out.append((v.detach(), x.grad))
        return out

    for full, topk in SimulatedWorld(tp).run(
        lambda r, grp: both(zs.chunk(tp, -1)[r], zt.chunk(tp, -1)[r], grp if tp > 1 else None)
    ):
        torch.testing.assert_close(topk[0], full[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(topk[1], full[1], rtol=1e-12, atol=1e-12)


def _on_ranks(tp, fn, *xs):
    """fn(shards of xs..., group) on tp simulated ranks; the per-rank results."""
    return SimulatedWorld(tp).run(lambda r, g: fn(*[x.chunk(tp, -1)[r] for x in xs], g if tp > 1 else None))


@settings(max_examples=10)
@given(seed=st.integers(0, 1000), tp=st.sampled_from([1, 2]), scale=st.sampled_from([1.0, 8.0]))
def test_beta_zero_gradient_is_p_minus_q(seed, tp, scale):
    g = torch.Generator().manual_seed(seed)
    zs, zt = (torch.randn(5, 8, generator=g, dtype=torch.float64) * scale for _ in range(2))

    def grad(s, t, grp):
        s = s.clone().requires_grad_(True)
        tilted_loss(s, t, 0.0, grp).sum().backward()
        return s.grad

    got = torch.cat(_on_ranks(tp, grad, zs, zt), -1)
    torch.testing.assert_close(got, torch.softmax(zs, -1) - torch.softmax(zt, -1), rtol=1e-12, atol=1e-12)


@settings(max_examples=10)
@given(seed=st.integers(0, 1000), tp=st.sampled_from([1, 2]), beta=st.sampled_from([0.0, 0.5, 2.0]))
def test_weights_sum_to_one_and_vanish_with_the_student(seed, tp, beta):
    g = torch.Generator().manual_seed(seed)
    zs, zt = (
        torch.randn(4, 8, generator=g, dtype=torch.float64),
        torch.randn(4, 8, generator=g, dtype=torch.float64),
    )
    zs[:, 3] = -200.0  # p_S(3) ~ e^-200
    logw = torch.cat(_on_ranks(tp, lambda s, t, grp: tilted_log_weights(s, t, beta, grp), zs, zt), -1)
    torch.testing.assert_close(logw.exp().sum(-1), torch.ones(4, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    if beta > 0:
        assert float(logw[:, 3].exp().max()) < 1e-40
    else:  # β = 0: the teacher's distribution itself
        torch.testing.assert_close(logw, torch.log_softmax(zt, -1), rtol=1e-12, atol=1e-12)


def test_teacher_equal_to_student_with_beta_zero_gives_zero_gradient():
    z = torch.randn(6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    s = z.clone().requires_grad_(True)
    tilted_loss(s, z, 0.0).sum().backward()
    assert float(s.grad.abs().max()) < 1e-15


def _batch(rewards, groups, V=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [3, 2, 4, 3][: len(rewards)]
    b = from_sequences(
        [[1]] * len(rewards), [torch.randint(0, V, (n,), generator=g).tolist() for n in lens], groups
    )
    T = b.num_tokens
    b.rewards = torch.tensor(rewards, dtype=torch.float64)
    logits, teacher = (
        torch.randn(T, V, generator=g, dtype=torch.float64),
        torch.randn(T, V, generator=g, dtype=torch.float64),
    )
    b.old_logprobs = torch.log_softmax(logits, -1)[torch.arange(T), b.tokens]
    b.advantages = torch.randn(T, generator=g, dtype=torch.float64) * b.loss_mask
    return b, logits, teacher


def _loss_grad(b, logits, teacher, regs):
    obj = build_objective({"policy_loss": "ppo", "regularisers": regs})
    b = obj.prepare(b, None)
    logits = logits.clone().requires_grad_(True)
    ctx = LossContext(GlobalNormalisers.from_batch(b), teacher_logits=teacher, step=7)
    out = obj(logits, b, ctx)
    out.loss.backward()
    return out.loss.detach(), logits.grad


def test_closed_gate_is_grpo_exactly():
    b, logits, teacher = _batch([1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1])  # both groups mixed: zero_variance closed
    got = _loss_grad(b, logits, teacher, [{"name": "skald", "coef": 3.0}])
    want = _loss_grad(b, logits, teacher, [])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    b.extras = {"teacher_acc": torch.tensor([0.5, 0.5, 0.0, 0.0])}  # teacher no better than the student
    got = _loss_grad(b, logits, teacher, [{"name": "skald", "coef": 3.0, "gate": "teacher_advantage"}])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_open_gate_uses_the_annealed_beta_of_the_step():
    b, logits, teacher = _batch([0.0, 0.0, 1.0, 0.0], [0, 0, 1, 1])  # group 0 zero-variance
    reg = {"name": "skald", "coef": 1.0, "beta0": 1.0, "anneal_steps": 14}  # step 7: β = 0.5
    loss, _ = _loss_grad(b, logits, teacher, [reg])
    base, _ = _loss_grad(b, logits, teacher, [])
    n = float(b.loss_mask.sum())
    rows = torch.arange(b.num_tokens) < int(b.cu_seqlens[2])
    want = (rd.skald_tilted_loss(logits, teacher, 0.5) * b.loss_mask * rows).sum() / n
    torch.testing.assert_close(loss - base, want, rtol=1e-10, atol=1e-12)


def test_schedule_endpoints():
    assert (
        skald_beta(0, 1.0, 100) == 1.0
        and skald_beta(100, 1.0, 100) == 0.0
        and skald_beta(500, 1.0, 100) == 0.0
    )
    assert skald_beta(50, 2.0, 100) == 1.0 and skald_beta(10**6, 0.7, 0) == 0.7
    for s in (0, 30, 100, 400):
        assert skald_beta(s, 1.0, 100) == rd.skald_beta(s, 1.0, 100)


def test_bad_input_is_named():
    b, logits, teacher = _batch([0.0, 0.0, 1.0, 0.0], [0, 0, 1, 1])
    with pytest.raises(ValueError, match="teacher_acc"):
        prepare(b, None, gate="teacher_advantage")
    with pytest.raises(ValueError, match="gate='sometimes'"):
        prepare(b, None, gate="sometimes")
    obj = build_objective({"policy_loss": "ppo", "regularisers": [{"name": "skald", "coef": 1.0}]})
    with pytest.raises(ValueError, match="objective.prepare"):
        obj(logits, b, LossContext(GlobalNormalisers(4, 4), teacher_logits=teacher))
    with pytest.raises(ValueError, match="teacher_logits"):
        obj(logits, obj.prepare(b, None), LossContext(GlobalNormalisers(4, 4)))
    assert dataclasses.is_dataclass(b)


def test_example_loads():
    cfg = load_example("skald")
    assert cfg["objective"]["regularisers"][0]["name"] == "skald"
