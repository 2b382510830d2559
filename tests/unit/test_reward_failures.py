"""Contained reward failures are classified and counted: a non-number (the string "0.75") and a
value beyond float32 (1e39) are errors with the fallback reward; a worker that exits or is killed
during a call is a worker death (not a timeout), and the next call gets a fresh worker."""

import math
import time

import pytest

from megarl.rewards.compute import RewardComputer
from megarl.trainer.config import RewardConfig, RewardFunctionConfig


def _computer(fn: str, timeout_s: float = 20.0) -> RewardComputer:
    return RewardComputer(
        RewardConfig(
            functions=[RewardFunctionConfig(name="r", kind="python", function=f"tests.unit.reward_fns:{fn}")],
            timeout_s=timeout_s,
            fallback=-1.0,
        )
    )


def test_values_are_real_numbers_finite_in_float32():
    from megarl.rewards.sandbox import check_reward_value

    assert check_reward_value(0.75) == (0.75, None) and check_reward_value(True) == (1.0, None)
    assert check_reward_value(3) == (3.0, None) and check_reward_value(-3.0e38) == (-3.0e38, None)
    for bad, why in [
        ("0.75", "returned str '0.75', not a number"),
        (None, "returned NoneType None"),
        (float("nan"), "non-finite nan"),
        (float("-inf"), "non-finite -inf"),
        (1e39, "returned 1e+39, beyond the float32 range"),
        (-1e39, "returned -1e+39"),
    ]:
        v, got = check_reward_value(bad)
        assert v is None and got.startswith("error: ") and why in got, (bad, got)


@pytest.mark.parametrize(
    "fn, responses, message",
    [
        ("returns_string", ["1", "2"], "returned str '0.75', not a number"),
        ("returns_huge", ["1", "-1"], "beyond the float32 range"),
    ],
)
def test_non_number_and_float32_overflow_are_contained_errors(fn, responses, message):
    comp = _computer(fn)
    try:
        res = comp(responses, ["1"] * len(responses))
    finally:
        comp.close()
    assert res.scalar.tolist() == [-1.0] * len(responses) and all(
        math.isfinite(x) for x in res.dims["r"].tolist()
    )
    assert (res.errors, res.timeouts, res.worker_deaths) == (len(responses), 0, 0)
    assert res.failures[0].startswith("reward 'r', sample 0: error: ") and message in res.failures[0]


@pytest.mark.parametrize(
    "fn, how", [("exits_on_seven", "exit code 3"), ("killed_on_seven", "killed by signal 9")]
)
def test_dead_worker_is_counted_as_a_death_and_replaced(fn, how):
    comp = _computer(fn, timeout_s=20.0)
    try:
        t0 = time.time()
        res = comp(["7", "12", "77", "3"], ["7", "12", "77", "4"])
        took = time.time() - t0
    finally:
        comp.close()
    assert res.scalar.tolist() == [-1.0, 1.0, -1.0, 0.0]  # fresh workers score the later samples
    assert (res.worker_deaths, res.timeouts, res.errors) == (2, 0, 0)
    assert (
        res.failures[0]
        == f"reward 'r', sample 0: worker died ({how}); a fresh worker starts on the next call"
    )
    assert took < 20, took  # a death is seen at once, not after the 20 s timeout
