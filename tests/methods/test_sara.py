"""SARA: the plugin's decisions equal reference/allocation.py's, and the invariants hold on simulated
Bernoulli prompts.

False-abandon bound tested: with each prompt's success rate p drawn from the allocator's prior
Beta(a0, b0), a prompt is abandoned only in a state whose posterior-predictive chance of ending
with mixed outcomes is P_eff <= tau_lo, so among abandoned prompts the fraction whose full group of
n would have been mixed (a false abandon) is at most tau_lo; checked on 3000 prompts per example
with a 3-sigma binomial margin.
"""

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.methods.allocation.sara import SARAAllocator, SARAKnobs, effectiveness
from megarl.plugin.allocation import ABANDON, PromptView
from megarl.plugin.knobs import build_knobs
from reference import allocation as ref

FAST = settings(max_examples=15, deadline=None)
SLOW = settings(max_examples=4, deadline=None)


def knobs(**kw) -> SARAKnobs:
    return build_knobs(SARAKnobs, kw, "method")


@FAST
@given(
    s=st.integers(0, 6),
    f=st.integers(0, 6),
    a0=st.floats(0.1, 20),
    b0=st.floats(0.1, 20),
    extra=st.integers(1, 6),
)
def test_effectiveness_equals_reference(s, f, a0, b0, extra):
    n = s + f + extra
    assert effectiveness(s, f, a0, b0, n) == pytest.approx(ref.sara_effectiveness(s, f, a0, b0, n), abs=1e-9)


def test_beta_moment_formula_matches_monte_carlo():
    """1 - E[p^m] and 1 - E[(1-p)^m] under the posterior against 200k posterior draws."""
    torch.manual_seed(0)
    for s, f, a0, b0, n in [
        (3, 0, 1.0, 1.0, 8),
        (0, 2, 0.5, 2.0, 8),
        (0, 4, 3.0, 1.0, 16),
        (2, 0, 0.3, 0.3, 5),
    ]:
        a, b, m = a0 + s, b0 + f, n - s - f
        p = torch.distributions.Beta(torch.tensor(a), torch.tensor(b)).sample((200_000,))
        mc = 1 - (p**m if f == 0 else (1 - p) ** m).double().mean().item()
        assert ref.sara_effectiveness(s, f, a0, b0, n) == pytest.approx(mc, abs=0.01)


@FAST
@given(
    outcomes=st.lists(st.sampled_from([0.0, 1.0]), max_size=7),
    shaped=st.booleans(),
    probe=st.integers(1, 4),
    lo=st.floats(0, 1),
    gap=st.floats(0, 1),
    hist=st.tuples(st.floats(0, 5), st.floats(0, 5)),
    mu=st.one_of(st.none(), st.floats(0, 1)),
    pooled=st.sampled_from([0.0, 2.0]),
)
def test_decide_equals_reference(outcomes, shaped, probe, lo, gap, hist, mu, pooled):
    n = 8
    hi = min(1.0, lo + gap)
    alloc = SARAAllocator(knobs(probe=probe, tau_lo=lo, tau_hi=hi, pooled_strength=pooled), want=4)
    alloc.history[7] = list(hist)
    alloc.mu = mu
    base = (1.0, 1.0) if pooled == 0 or mu is None else ref.sara_pooled_prior(mu, pooled)
    a0, b0 = ref.sara_prior(*hist, *base)
    rewards = [o + 0.5 * (shaped and j == 1) for j, o in enumerate(outcomes)]  # a format bonus
    view = PromptView(7, 0, tuple(outcomes), tuple(rewards), n)
    assert alloc.decide(view) == ref.sara_decide(outcomes, n, a0, b0, probe, lo, hi, rewards)


@FAST
@given(outcomes=st.lists(st.sampled_from([0.0, 1.0]), max_size=7), probe=st.integers(1, 4))
def test_tau_lo_zero_never_abandons(outcomes, probe):
    alloc = SARAAllocator(knobs(probe=probe, tau_lo=0.0, tau_hi=1.0), want=4)
    assert alloc.decide(PromptView(0, 0, tuple(outcomes), tuple(outcomes), 8)) != ABANDON


def test_tau_lo_zero_is_standard_sampling():
    """With tau_lo = 0 every opened prompt is committed: the step is want groups of n, as uniform."""
    rng = random.Random(0)
    k = ref.sara_prior(0, 0)
    steps = ref.simulate_step(
        lambda slot, seen: ref.sara_decide(seen, 8, *k, 2, 0.0, 0.9),
        lambda slot, j: float(rng.random() < 0.5),
        n=8,
        want=16,
        budget=128,
    )
    assert [(st_, iss) for st_, iss, _ in steps] == [("committed", 8)] * 16


def _population(rng: random.Random, a: float, b: float, count: int) -> list[float]:
    return [rng.betavariate(a, b) for _ in range(count)]


@SLOW
@given(
    a0=st.sampled_from([0.3, 1.0, 2.0]),
    b0=st.sampled_from([0.3, 1.0, 3.0]),
    lo=st.sampled_from([0.1, 0.2, 0.35]),
    probe=st.integers(1, 4),
)
def test_false_abandon_rate_is_below_tau_lo(a0, b0, lo, probe):
    """Prompts with p ~ Beta(a0, b0) (the allocator's prior): false abandons / abandons <= tau_lo."""
    n, rng = 8, random.Random(hash((a0, b0, lo, probe)) % 2**32)
    abandoned = false = 0
    for p in _population(rng, a0, b0, 3000):
        draws = [float(rng.random() < p) for _ in range(n)]
        seen: list[float] = []
        while len(seen) < n:
            t = ref.sara_decide(seen, n, a0, b0, probe, lo, 1.0)
            if t == ABANDON:
                abandoned += 1
                false += ref.effective(draws)  # the full group would have had a gradient
                break
            seen = draws[:t]
    if abandoned >= 50:
        margin = 3 * (lo * (1 - lo) / abandoned) ** 0.5
        assert false / abandoned <= lo + margin, (false, abandoned)


def _yield(decide, probs, n, want, steps, rng):
    """Effective groups and samples spent over ``steps`` steps on a prompt population."""
    eff = spent = 0
    for _ in range(steps):
        ps = [rng.choice(probs) for _ in range(200)]
        draws = [[float(rng.random() < p) for _ in range(n)] for p in ps]
        out = ref.simulate_step(decide, lambda slot, j, d=draws: d[slot][j], n, want, want * n)
        eff += sum(1 for st_, _, seen in out if st_ == "committed" and ref.effective(seen))
        spent += sum(iss for _, iss, _ in out)
    return eff, spent


def test_fixed_budget_yield_beats_uniform_and_dynamic_sampling():
    """Same budget per step (want x n samples) on a population where most groups are all-correct
    or all-wrong: SARA commits more effective groups than uniform allocation, and spends fewer
    samples per effective group than dynamic sampling (whose samples per effective group are
    uniform's: it draws whole groups and drops the equal ones)."""
    rng = random.Random(1)
    probs = _population(rng, 0.3, 0.3, 400)
    n, want, steps = 8, 16, 40
    a0, b0 = 0.3, 0.3
    uni_eff, uni_spent = _yield(lambda s, seen: n, probs, n, want, steps, random.Random(2))
    sara_eff, sara_spent = _yield(
        lambda s, seen: ref.sara_decide(seen, n, a0, b0, 2, 0.2, 0.8), probs, n, want, steps, random.Random(2)
    )
    assert uni_spent == steps * want * n >= sara_spent  # a step's leftover below n opens no prompt
    assert sara_eff > uni_eff, (sara_eff, uni_eff)  # 303 vs 273 effective groups here
    assert sara_spent / sara_eff < uni_spent / uni_eff


def test_history_prior_and_state_round_trip():
    alloc = SARAAllocator(knobs(history_decay=0.5, pooled_strength=2.0), want=2)
    views = [
        (PromptView(3, 0, (1.0, 1.0), (1.0, 1.0), 4), False),
        (PromptView(5, 1, (0.0, 1.0, 0.0, 1.0), (0,) * 4, 4), True),
    ]
    m = alloc.end_step(1, views)
    alloc.end_step(2, [(PromptView(3, 0, (1.0, 0.0, 1.0, 1.0), (1.0,) * 4, 4), True)])
    assert alloc.history[3] == [0.5 * 2 + 3, 0.5 * 0 + 1]
    assert alloc.mu == pytest.approx(
        ref.sara_running_rate(ref.sara_running_rate(None, 4 / 6, 0.5), 0.75, 0.5)
    )
    assert m["sara/abandoned_total"] == 1 and m["sara/committed_total"] == 1
    state = json.loads(json.dumps(alloc.state_dict()))  # plain data
    back = SARAAllocator(knobs(history_decay=0.5, pooled_strength=2.0), want=2)
    back.load_state_dict(state)
    assert back.history == alloc.history and back.mu == alloc.mu and back.totals == alloc.totals
    assert (
        back.prior(3)
        == alloc.prior(3)
        == ref.sara_prior(*alloc.history[3], *ref.sara_pooled_prior(alloc.mu, 2.0))
    )
    for seen in [(), (1.0,), (1.0, 1.0), (0.0, 0.0, 0.0)]:
        v = PromptView(3, 0, seen, seen, 4)
        assert back.decide(v) == alloc.decide(v)


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"probe": 0}, "method: probe=0 must be >= 1"),
        ({"tau_lo": 0.9, "tau_hi": 0.5}, "need 0 <= tau_lo <= tau_hi <= 1"),
        ({"prior_a": 0.0}, "must be > 0"),
        ({"history_decay": 1.5}, "history_decay=1.5 must be in"),
        ({"budget_samples": -1}, "budget_samples=-1 must be >= 0"),
        ({"tau": 0.1}, "unknown key method.tau"),
    ],
)
def test_bad_knobs_are_named(bad, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        knobs(**bad)
