"""PAIR: the plugin's design, draws and advantages equal reference/allocation.py's, and the spec's
invariants hold (U-statistic identity, pi == 1 is RLOO, design-unbiasedness of the HT estimator and
the bias of the unweighted one, the budget in expectation)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.advantages.estimators import compute_advantages
from megarl.batch import from_sequences
from megarl.methods.allocation.pair import (
    PI,
    SIZE,
    PAIRAllocator,
    PAIRKnobs,
    contrast_weights,
    design_objective,
    inclusion_design,
    pair_advantages,
)
from megarl.plugin.allocation import PrefixView
from megarl.plugin.knobs import build_knobs
from reference import allocation as ref

FAST = settings(max_examples=10, deadline=None)
SLOW = settings(max_examples=4, deadline=None)

probs = st.floats(0.05, 0.95)


@FAST
@given(R=st.lists(st.floats(-2, 2), min_size=2, max_size=7), seed=st.integers(0, 1000))
def test_loo_gradient_is_the_pair_u_statistic(R, seed):
    s = torch.randn(len(R), 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    loo = ref.pair_loo_gradient(R, list(s))
    assert torch.allclose(loo, ref.pair_u_statistic(R, list(s)), atol=1e-12)


@FAST
@given(
    groups=st.lists(
        st.lists(st.tuples(st.floats(-1, 1), st.floats(0.1, 1.0), st.booleans()), min_size=2, max_size=6),
        min_size=1,
        max_size=3,
    )
)
def test_collapsed_advantages_equal_the_reference_pair_sum(groups):
    """pair_advantages (batch form over kept samples, no normaliser) x 1/n equals the reference's
    per-sample A_i; with score vectors, sum_i A_i s_i equals the HT pair gradient."""
    R, gid, pi, size, ref_adv = [], [], [], [], []
    for g, rows in enumerate(groups):
        Rg = [r for r, _, _ in rows]
        pig = [p for _, p, _ in rows]
        incl = [int(k) for _, _, k in rows]
        a = ref.pair_ht_advantages(Rg, incl, pig)
        for j, (r, p, k) in enumerate(rows):
            if k:
                R.append(r), gid.append(g), pi.append(p), size.append(len(rows)), ref_adv.append(a[j])
    if not R:
        return
    got = pair_advantages(
        torch.tensor(R), torch.tensor(gid), torch.tensor(pi), torch.tensor(size, dtype=torch.float64), False
    )
    n = torch.tensor(size, dtype=torch.float64)
    equal = torch.tensor([len({R[i] for i in range(len(R)) if gid[i] == gid[k]}) == 1 for k in range(len(R))])
    expect = torch.where(
        equal, torch.zeros(len(R), dtype=torch.float64), torch.tensor(ref_adv, dtype=torch.float64)
    )
    assert torch.allclose(got / n, expect, atol=1e-9)
    rows = groups[0]
    s = torch.randn(len(rows), 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    Rg, pig, incl = [r for r, _, _ in rows], [p for _, p, _ in rows], [int(k) for _, _, k in rows]
    a = ref.pair_ht_advantages(Rg, incl, pig)
    assert torch.allclose(
        sum(a[i] * s[i] for i in range(len(rows))), ref.pair_ht_gradient(Rg, list(s), incl, pig)
    )


def test_pi_one_is_rloo_exactly_through_the_registered_estimator():
    torch.manual_seed(0)
    gid = [0] * 4 + [1] * 4 + [2] * 4
    R = torch.tensor([1.0, 0, 0, 1, 0.3, 0.7, 0.1, 0.9, 1, 1, 1, 1])
    prompts = [[1, 2, 3]] * 12
    responses = [[4 + (i % 3)] * (1 + i % 4) for i in range(12)]
    b1 = from_sequences(prompts, responses, gid, rewards=R)
    b2 = from_sequences(prompts, responses, gid, rewards=R)
    b1.extras[PI] = torch.ones(12, dtype=torch.float64)
    b1.extras[SIZE] = torch.full((12,), 4.0, dtype=torch.float64)
    a = compute_advantages(b1, "pair_ht")
    r = compute_advantages(b2, "rloo")
    assert torch.allclose(a, r, atol=1e-7) and bool((a[b1.loss_mask > 0] != 0).any())


def test_estimator_without_the_extras_names_them():
    b = from_sequences([[1]] * 2, [[2], [3]], [0, 0], rewards=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"pair_ht needs batch.extras \['pair_pi', 'pair_size'\]"):
        compute_advantages(b, "pair_ht")


def _design_case(draw):
    G = draw(st.integers(3, 5))
    p = [draw(probs) for _ in range(G)]
    c = [draw(st.sampled_from([0.0, 1.0, 2.5, 4.0])) for _ in range(G)]
    return p, c, draw(st.floats(0.2, 0.9)), draw(st.sampled_from([0.05, 0.1, 0.3]))


@SLOW
@given(case=st.composite(_design_case)())
def test_design_equals_the_reference_optimiser_and_meets_the_budget(case):
    """Coordinate descent + multiplier bisection (plugin) and projected gradient (reference) reach
    the same optimum; the budget holds; interior coordinates satisfy the stationarity condition."""
    p, c, frac, pi_min = case
    B = frac * sum(c)
    got = inclusion_design(p, c, B, pi_min)
    want = ref.pair_design(p, c, B, pi_min)
    assert got == pytest.approx(want, abs=1e-5)
    assert design_objective(got, contrast_weights(p)) == pytest.approx(
        ref.pair_design_objective(want, p), rel=1e-7
    )
    assert sum(x * ci for x, ci in zip(got, c)) <= max(B, pi_min * sum(c)) + 1e-9
    assert all(x == 1.0 for x, ci in zip(got, c) if ci == 0)
    assert all(pi_min - 1e-12 <= x <= 1.0 for x in got)


def test_budget_holds_in_expectation_over_draws():
    p, c = [0.2, 0.5, 0.8, 0.4, 0.6, 0.3], [3.0, 2.0, 4.0, 0.0, 1.0, 5.0]
    B = 0.4 * sum(c)
    pi = torch.tensor(inclusion_design(p, c, B, 0.1), dtype=torch.float64)
    draws = torch.rand(200_000, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64) < pi
    spend = (draws.double() * torch.tensor(c, dtype=torch.float64)).sum(1)
    assert float((pi * torch.tensor(c, dtype=torch.float64)).sum()) <= B + 1e-9
    assert float(spend.mean()) <= B + 4 * float(spend.std()) / 200_000**0.5


def test_ht_is_design_unbiased_and_the_unweighted_estimator_is_not():
    """1e5 Poisson inclusion draws on a frozen population (G = 6, score vectors in R^3): the mean of
    the HT estimator (collapsed advantages, one backward) matches the full-pair gradient within 4
    Monte-Carlo standard errors; dropping the 1/pi weights misses it by far more."""
    g = torch.Generator().manual_seed(3)
    G, D, M = 6, 3, 100_000
    R = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    s = torch.randn(G, D, generator=g, dtype=torch.float64)
    full = ref.pair_u_statistic(R.tolist(), list(s))
    pi = torch.tensor(inclusion_design([0.7, 0.2, 0.6, 0.3, 0.25, 0.8], [4.0] * G, 0.4 * 4 * G, 0.1))
    incl = (torch.rand(M, G, generator=g, dtype=torch.float64) < pi).double()

    def estimates(weighted: bool) -> torch.Tensor:
        w = incl / pi if weighted else incl  # w_i = I_i / pi_i
        s_w, s_wr = w.sum(1, keepdim=True), (w * R).sum(1, keepdim=True)
        adv = w * (R * s_w - s_wr) / (G * (G - 1))  # I_i/(G(G-1)) sum_j I_j (R_i - R_j)/(pi_i pi_j)
        return adv @ s  # [M, D]

    ht = estimates(True)
    se = ht.std(0) / M**0.5
    assert bool(((ht.mean(0) - full).abs() <= 4 * se).all()), (ht.mean(0), full, se)
    raw = estimates(False)
    assert bool(((raw.mean(0) - full).abs() > 10 * raw.std(0) / M**0.5).any())
    # one draw of the batch form equals the reference pair sum
    i0 = incl[0].bool()
    one = ref.pair_ht_gradient(R.tolist(), list(s), i0.tolist(), pi.tolist())
    assert torch.allclose(ht[0], one, atol=1e-12)


def _view(uid, slot, n, lens, finished, seed, max_new=8):
    g = torch.Generator().manual_seed(seed)
    return PrefixView(
        uid,
        slot,
        tuple(tuple(range(L)) for L in lens),
        tuple(tuple((-torch.rand(L, generator=g, dtype=torch.float64) * 3).tolist()) for L in lens),
        tuple(finished),
        n,
        max_new,
    )


@SLOW
@given(
    lens=st.lists(st.integers(1, 3), min_size=3, max_size=5),
    fin=st.lists(st.booleans(), min_size=6, max_size=6),
    seed=st.integers(0, 10_000),
    step=st.integers(1, 50),
)
def test_allocator_decisions_equal_the_reference(lens, fin, seed, step):
    """choose(): pi from the reference design on the predictor's (p, c), keep flags from the
    reference draw on the allocator's seeded uniforms; the extras carry pi and n."""
    alloc = PAIRAllocator(PAIRKnobs(), want=4, seed=seed)
    view = _view(seed % 97, step % 4, len(lens), lens, fin[: len(lens)], seed)
    dec = alloc.choose(step, view)
    p, c = alloc.predict(view)
    pi = ref.pair_design(p, c, 0.5 * sum(c), 0.1)
    assert list(dec.extras[PI]) == pytest.approx(pi, abs=1e-5)
    u = alloc.uniforms(step, view)
    close = [abs(a - b) < 1e-4 for a, b in zip(u, pi)]
    assert [k for k, cl in zip(dec.keep, close) if not cl] == [
        k for k, cl in zip(ref.pair_draw(pi, u), close) if not cl
    ]
    assert dec.extras[SIZE] == (float(len(lens)),) * len(lens)
    assert all(k for k, f in zip(dec.keep, view.finished) if f)  # an ended prefix costs nothing: pi = 1
    assert alloc.choose(step, view) == dec  # no hidden state in a decision


def test_end_step_learns_and_state_round_trips():
    alloc = PAIRAllocator(PAIRKnobs(prefix_tokens=2), want=2, seed=0)
    v1 = _view(3, 0, 4, [2, 2, 2, 2], [False] * 4, 1)
    v2 = _view(5, 1, 4, [2, 1, 2, 2], [False, True, False, False], 2)
    d1, d2 = alloc.choose(1, v1), alloc.choose(1, v2)
    k1 = [j for j, k in enumerate(d1.keep) if k]
    metrics = alloc.end_step(1, [(v1, d1, tuple(1.0 for _ in k1), tuple(6 for _ in k1)), (v2, d2, (), ())])
    assert alloc.history[3] == [float(len(k1)), 0.0] and 5 not in alloc.history
    assert alloc.cont_len == pytest.approx(4.0)  # 6 tokens - a prefix of 2
    assert alloc.weights != [0.0, 0.0, 1.0]  # the predictor took its steps
    assert metrics["pair/kept_frac"] == pytest.approx(len(k1) / 8)
    other = PAIRAllocator(PAIRKnobs(prefix_tokens=2), want=2, seed=0)
    other.load_state_dict(alloc.state_dict())
    assert other.state_dict() == alloc.state_dict()
    assert other.choose(2, v1) == alloc.choose(2, v1)


def test_knobs_refuse_bad_values():
    with pytest.raises(ValueError, match="budget_frac"):
        build_knobs(PAIRKnobs, {"budget_frac": 0.0}, "method")
    with pytest.raises(ValueError, match="pi_min"):
        build_knobs(PAIRKnobs, {"pi_min": 1.5}, "method")
