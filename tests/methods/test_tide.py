"""TIDE: megarl (prepared on every DP shard, TP 1/2, micro-batched) equals
reference/distillation.py:tide_loss in loss and gradient, and the invariants of the authors' CPU
tests: the shaping h, the Hellinger identities, the gates, the deficit statistic and its gradient,
independent branches, zero on matched positions."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.distillation as rd
from megarl.batch import from_sequences, unpack
from megarl.methods.distillation.tide import deficit_statistic, excess_shaping, gates, prepare
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective
from megarl.testing.equivalence import split_sequences
from megarl.testing.simulated_group import SimulatedWorld
from tests.methods.trust_regions_harness import (
    aggregate,
    assert_equivalent,
    megarl_method_loss_and_grad,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases

KNOBS = st.fixed_dictionaries(
    {
        "rho_minus": st.sampled_from([0.0, 0.3, 1.0]),
        "rho_plus": st.sampled_from([0.0, 0.5, 1.0]),
        "lam": st.sampled_from([1.0, 0.5]),
        "clip_low": st.just(0.2),
        "clip_high": st.sampled_from([0.2, 0.28]),
    }
)
AGGS = ("token-mean", "seq-mean-token-mean")
CFGS = st.builds(
    lambda agg, knobs: ObjectiveConfig(
        policy_loss="none", aggregation=agg, regularisers=[{"name": "tide", "coef": 0.7, **knobs}]
    ),
    st.sampled_from(AGGS),
    KNOBS,
)


def _add_topk(b, teacher_logits: torch.Tensor, K: int, seed: int) -> None:
    """The teacher's top-K from its logits, and the behaviour policy's logprobs at those ids."""
    g = torch.Generator().manual_seed(seed)
    lt = torch.log_softmax(teacher_logits.double(), -1)
    top = lt.topk(K, -1)
    old = torch.log_softmax(torch.randn(teacher_logits.shape, generator=g, dtype=torch.float64) * 2, -1)
    b.token_extras = {
        "teacher_topk_ids": top.indices,
        "teacher_topk_logprobs": top.values,
        "student_topk_logprobs": old.gather(-1, top.indices),
    }


def _padded(b, name: str) -> torch.Tensor:
    am = unpack(b).attention_mask
    x = b.token_extras[name]
    out = torch.zeros(am.shape + x.shape[1:], dtype=x.dtype)
    out[am] = x
    return out


def _reference(case):
    knobs = {k: v for k, v in case.cfg.regularisers[0].items() if k not in ("name", "coef")}
    coef = case.cfg.regularisers[0]["coef"]
    b = case.batch

    def fn(full, pad):
        tok = pad.per_token
        per_token = rd.tide_loss(
            full,
            pad.tokens,
            tok["old_logprobs"],
            tok["teacher_logprobs"],
            _padded(b, "teacher_topk_ids"),
            _padded(b, "teacher_topk_logprobs"),
            _padded(b, "student_topk_logprobs"),
            pad.loss_mask,
            **knobs,
        )
        return coef * aggregate(per_token, pad, case.cfg.aggregation)

    return reference_method_loss_and_grad(case, fn)


@settings(max_examples=6)
@given(
    case=rl_cases(torch.float64, cfgs=CFGS, vocab_sizes=(4, 8, 12)),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
    K=st.integers(1, 4),
)
def test_matches_reference(case, tp, dp, mb, K):
    _add_topk(case.batch, case.teacher_logits, K, case.batch.num_tokens)
    mb = min(mb, -(-case.batch.num_seqs // dp))
    assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, mb), _reference(case), case.logits)


@given(a=st.floats(-50, 50, allow_subnormal=False))  # a/2 of the smallest subnormal rounds to 0
def test_excess_shaping(a):
    h = float(excess_shaping(torch.tensor(a, dtype=torch.float64)))
    assert (h > 0) == (a > 0) and (h < 0) == (a < 0) and h > -2
    small = torch.tensor([1e-4, -1e-4], dtype=torch.float64)
    assert float(excess_shaping(torch.tensor(0.0))) == 0.0
    assert torch.allclose(excess_shaping(small), small, rtol=1e-4, atol=0)  # h(a) = a + O(a²)


def test_hellinger_identities():
    """E_{v~q}[h²] = 8 H²(p, q); the detached-coefficient policy gradient Σ_v q_v h_v ∇log q_v = -4 ∇H²."""
    g = torch.Generator().manual_seed(1)
    zq, zp = (
        torch.randn(9, generator=g, dtype=torch.float64),
        torch.randn(9, generator=g, dtype=torch.float64),
    )
    z = zq.clone().requires_grad_(True)
    lq, lp = torch.log_softmax(z, -1), torch.log_softmax(zp, -1)
    h = excess_shaping(lp - lq.detach())
    h2 = rd.hellinger_sq(z, zp)
    assert torch.allclose((lq.detach().exp() * h**2).sum(), 8 * h2.detach())
    (grad_h2,) = torch.autograd.grad(h2, z)
    (pg,) = torch.autograd.grad((lq.detach().exp() * h.detach() * lq).sum(), z)
    assert torch.allclose(pg, -4 * grad_h2)


def _batch(T_resp=(5, 4, 6), V=10, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = from_sequences(
        [[1]] * len(T_resp), [torch.randint(0, V, (n,), generator=g).tolist() for n in T_resp], [0, 1, 2]
    )
    T = b.num_tokens
    logits = torch.randn(T, V, generator=g, dtype=torch.float64) * 2
    b.old_logprobs = torch.log_softmax(logits, -1)[torch.arange(T), b.tokens]
    b.teacher_logprobs = -torch.rand(T, generator=g, dtype=torch.float64) * 4
    teacher = torch.randn(T, V, generator=g, dtype=torch.float64) * 2
    _add_topk(b, teacher, K, seed)
    b.token_extras["student_topk_logprobs"] = torch.log_softmax(logits, -1).gather(
        -1, b.token_extras["teacher_topk_ids"]
    )
    return b, logits


@settings(max_examples=10)
@given(rho_m=st.floats(0, 1), rho_p=st.floats(0, 1), seed=st.integers(0, 500), dp=st.sampled_from([1, 2, 3]))
def test_gates_keep_the_fraction_respect_the_mask_and_equal_over_dp(rho_m, rho_p, seed, dp):
    b, _ = _batch(seed=seed)
    whole = gates(prepare(b, None, rho_minus=rho_m, rho_plus=rho_p))
    shards = split_sequences(b.num_seqs, dp)
    parts = SimulatedWorld(dp).run(
        lambda r, grp: gates(prepare(b.select(shards[r]), grp, rho_minus=rho_m, rho_plus=rho_p))
    )
    for i in range(2):
        assert torch.equal(torch.cat([p[i] for p in parts]), whole[i])  # DP shards = the whole batch
    valid = b.loss_mask > 0
    a = b.teacher_logprobs - b.old_logprobs
    in_m, in_p = whole
    assert not bool((in_m & ~valid).any()) and not bool((in_p & ~valid).any())
    assert bool((a[in_m] < 0).all())  # the excess set holds only a < 0
    n = int(valid.sum())
    d = deficit_statistic(b.token_extras["teacher_topk_logprobs"], b.token_extras["student_topk_logprobs"])
    want = {0.0: 0, 1.0: n}.get(rho_p)
    if want is None and len(set(d[valid].tolist())) == n:  # distinct values: ρ·n up to the interpolation
        want = int(in_p.sum())
        assert abs(want - rho_p * n) <= 1 + 1e-9
    assert int(in_p.sum()) == want
    if rho_m == 0.0:
        assert not bool(in_m.any())
    if rho_m == 1.0:
        assert torch.equal(in_m, valid & (a < 0))


def test_deficit_statistic():
    g = torch.Generator().manual_seed(3)
    t = torch.log_softmax(torch.randn(4, 6, generator=g, dtype=torch.float64), -1).topk(3, -1).values
    lbar = torch.log_softmax(t, -1)
    zero = torch.zeros(4, dtype=torch.float64)
    assert torch.allclose(deficit_statistic(t, lbar), zero)  # the student covers p̄ exactly
    s = lbar - 0.5  # less mass on the top-K than p̄: the top-K KL without renormalisation, > 0
    kl = (lbar.exp() * (lbar - s)).sum(-1)
    assert torch.allclose(deficit_statistic(t, s), kl) and bool((kl > 0).all())
    assert torch.equal(deficit_statistic(t, lbar + 0.3), zero)  # leaked mass: d < 0, clamped


def _loss_grad(b, logits, **knobs):
    obj = build_objective(
        {
            "policy_loss": "none",
            "aggregation": "token-mean",
            "regularisers": [{"name": "tide", "coef": 1.0, **knobs}],
        }
    )
    b = obj.prepare(b, None)
    z = logits.clone().requires_grad_(True)
    out = obj(z, b, LossContext(GlobalNormalisers.from_batch(b)))
    out.loss.backward()
    return out, z.grad, b


def test_deficit_gradient_is_lambda_q_minus_pbar_and_excess_off():
    b, logits = _batch()
    lam = 0.7
    _, grad, pb = _loss_grad(b, logits, rho_minus=0.0, rho_plus=1.0, lam=lam)
    n = float(pb.loss_mask.sum())
    q = torch.softmax(logits, -1)
    pbar = torch.zeros_like(q).scatter(
        -1, b.token_extras["teacher_topk_ids"], torch.softmax(b.token_extras["teacher_topk_logprobs"], -1)
    )
    want = lam * (q - pbar) * pb.loss_mask.unsqueeze(-1) / n  # on-policy: every ratio is 1
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-12)


def test_branches_are_independent_and_matched_positions_get_zero():
    b, logits = _batch(seed=5)
    _, g_none, _ = _loss_grad(b, logits, rho_minus=0.0, rho_plus=0.0)
    assert torch.equal(g_none, torch.zeros_like(g_none))
    _, g_ex, pb = _loss_grad(b, logits, rho_minus=0.4, rho_plus=0.0)
    in_m, _ = gates(pb)
    assert bool(g_ex[in_m].abs().sum() > 0) and torch.equal(g_ex[~in_m], torch.zeros_like(g_ex[~in_m]))
    _, g_both, pb = _loss_grad(b, logits, rho_minus=0.4, rho_plus=0.3)
    in_m, in_p = gates(pb)
    off = ~(in_m | in_p)
    assert torch.equal(g_both[off], torch.zeros_like(g_both[off]))


def test_missing_inputs_and_prepare_are_named():
    b, logits = _batch()
    with pytest.raises(ValueError, match="teacher_logprobs"):
        prepare(dataclasses.replace(b, teacher_logprobs=None), None)
    bad = dataclasses.replace(
        b, token_extras={k: v for k, v in b.token_extras.items() if k != "student_topk_logprobs"}
    )
    assert prepare(bad, None) is bad  # a stage without the policy's top-K pass (not the last) skips
    obj = build_objective({"policy_loss": "none", "regularisers": [{"name": "tide", "coef": 1.0}]})
    with pytest.raises(ValueError, match="student_topk_logprobs"):
        obj(logits, obj.prepare(bad, None), LossContext(GlobalNormalisers(4, 3)))
    obj = build_objective({"policy_loss": "none", "regularisers": [{"name": "tide", "coef": 1.0}]})
    with pytest.raises(ValueError, match="objective.prepare"):
        obj(logits, b, LossContext(GlobalNormalisers(4, 3)))
