"""PAC: the plugin's signals, posterior updates, probabilities and counts equal
reference/allocation.py's, and the spec's invariants hold (counts sum to the budget, beta = 0 is a
learnability-only curriculum, identical tasks get a uniform allocation in expectation, a falling
task gets less mass than an otherwise identical rising one, fixed seed -> same prompts, resume
picks the same prompts)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.methods.allocation.pac import PACAllocator, PACKnobs, counts_for, task_signals
from megarl.plugin.allocation import GroupOutcome
from megarl.plugin.knobs import build_knobs
from reference import allocation as ref

FAST = settings(max_examples=15, deadline=None)
TASKS = ["add", "copy", "reverse"]


def pac(**kw) -> PACAllocator:
    a = PACAllocator(build_knobs(PACKnobs, kw, "method"), want=12)
    a.bind([TASKS[i % 3] for i in range(60)], seed=3)
    return a


groups_st = st.lists(
    st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=2, max_size=4).map(tuple), min_size=1, max_size=4
)


@FAST
@given(groups=groups_st)
def test_task_signals_equal_reference(groups):
    got, want = task_signals(groups), ref.pac_task_stats(groups)
    assert got == pytest.approx(want, abs=1e-9)


@FAST
@given(
    steps=st.lists(st.dictionaries(st.sampled_from(TASKS), groups_st, min_size=1), min_size=1, max_size=4),
    beta=st.sampled_from([0.0, 1.0, 2.5]),
    clip=st.booleans(),
)
def test_posterior_updates_equal_reference(steps, beta, clip):
    a = pac(beta=beta, clip_progress=clip, ema=0.6, discount=0.8)
    state: dict = {}
    for s, obs in enumerate(steps):
        a.observe(s, [GroupOutcome(0, t, g) for t, gs in obs.items() for g in gs])
        state = ref.pac_update(
            state, {t: ref.pac_task_stats(gs) for t, gs in obs.items()}, beta, 0.6, 0.8, clip
        )
    assert sorted(a.stats) == sorted(state)
    for t in state:
        for key in ("L", "P", "last", "n", "s"):
            assert a.stats[t][key] == pytest.approx(state[t][key], abs=1e-9), (t, key)
        assert a.posterior(t) == pytest.approx(ref.pac_posterior(state[t]), abs=1e-12)


@FAST
@given(
    draws=st.lists(st.floats(-3, 3), min_size=3, max_size=3),
    temp=st.floats(0.2, 3),
    eps=st.floats(0, 1),
    total=st.integers(0, 40),
)
def test_probabilities_and_counts_equal_reference_and_sum_to_the_budget(draws, temp, eps, total):
    a = pac(temperature=temp, epsilon=eps)
    a.stats = {"copy": {"L": 1.0, "P": 0.0, "last": 0.5, "n": 2.0, "s": 1.5}}
    theta = []
    for t, z in zip(TASKS, draws):
        mu, sd = ref.pac_posterior(a.stats.get(t, {"n": 0.0, "s": 0.0}))
        theta.append(mu + sd * z)
    p = a.probabilities(draws)
    assert p == pytest.approx(ref.pac_probs(theta, temp, eps), abs=1e-12)
    c = counts_for(p, total)
    assert c == ref.largest_remainder(p, total) and sum(c) == total


HI, LO = (0.0, 1.0, 1.0, 1.0), (0.0, 0.0, 0.0, 1.0)  # mean 0.75 / 0.25, the same mean |A|


def _rise_and_fall(a: PACAllocator) -> None:
    """'add' goes 0.25 -> 0.75 (rising), 'copy' 0.75 -> 0.25 (falling), same |A| every step."""
    for s in range(6):
        a.observe(
            s, [GroupOutcome(0, "add", LO if s < 3 else HI), GroupOutcome(1, "copy", HI if s < 3 else LO)]
        )


def test_beta_zero_is_a_learnability_only_curriculum():
    """With beta = 0 the rising and the falling task keep equal posteriors (their |A| is the same);
    with beta = 1 the rising one leads."""
    a0, a1 = pac(beta=0.0), pac(beta=1.0)
    _rise_and_fall(a0)
    _rise_and_fall(a1)
    assert a0.posterior("add") == a0.posterior("copy")
    assert a1.posterior("add")[0] > a1.posterior("copy")[0]


def _mass(a: PACAllocator, steps: int = 400) -> dict[str, float]:
    tot = dict.fromkeys(TASKS, 0)
    for s in range(steps):
        a.next_prompts(s, 12)
        for t, c in a.last_counts.items():
            tot[t] += c
    return {t: v / (12 * steps) for t, v in tot.items()}


def test_identical_tasks_get_a_uniform_allocation_in_expectation():
    a = pac()
    same = (0.0, 1.0, 1.0, 0.0)
    a.observe(0, [GroupOutcome(0, t, same) for t in TASKS])
    assert len({a.posterior(t) for t in TASKS}) == 1
    for t, m in _mass(a).items():
        assert m == pytest.approx(1 / 3, abs=0.03), (t, m)


def test_a_falling_task_gets_less_mass_than_a_rising_one():
    """'add' and 'copy' have the same |A|; 'copy''s reward falls, 'add''s rises."""
    a = pac(beta=1.0)
    _rise_and_fall(a)
    mass = _mass(a)
    assert mass["copy"] < mass["add"], mass


def test_fixed_seed_same_prompts_and_resume_picks_the_same():
    a, b = pac(), pac()
    assert [a.next_prompts(s, 12) for s in range(5)] == [b.next_prompts(s, 12) for s in range(5)]
    a.observe(5, [GroupOutcome(0, "add", (0.0, 1.0))])
    state = a.state_dict()
    c = pac()
    c.load_state_dict(state)
    assert [a.next_prompts(s, 12) for s in range(6, 40)] == [c.next_prompts(s, 12) for s in range(6, 40)]
    fresh = pac()
    one_pass = fresh._take("copy", 20)  # 'copy' has 20 rows: a pass is a permutation of them
    assert sorted(one_pass) == fresh.rows["copy"] and fresh.cursors["copy"] == [1, 0]


def test_prompts_come_from_their_tasks():
    a = pac()
    rows = a.next_prompts(0, 12)
    got = [TASKS[u % 3] for u in rows]
    assert got == [t for t in a.rows for _ in range(a.last_counts[t])]
    assert sum(a.last_counts.values()) == 12


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"ema": 1.0}, "ema=1.0 must be in"),
        ({"discount": 0.0}, "discount=0.0 must be in"),
        ({"temperature": 0.0}, "temperature=0.0 must be > 0"),
        ({"epsilon": 2.0}, "epsilon=2.0 must be in"),
    ],
)
def test_bad_knobs_are_named(bad, msg):
    with pytest.raises(ValueError, match=msg):
        build_knobs(PACKnobs, bad, "method")


def test_random_prompt_pool_sanity():
    rng = random.Random(0)
    a = pac(epsilon=1.0)  # uniform floor only: exactly B/K per task when divisible
    a.next_prompts(rng.randrange(100), 12)
    assert set(a.last_counts.values()) == {4}
