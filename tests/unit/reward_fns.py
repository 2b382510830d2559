"""Misbehaving reward functions for tests/unit/test_reward_failures.py (imported by path in the
contained worker)."""

import os
import signal


def returns_string(response: str, answer: str) -> str:
    """A number as text: a wrong return type however plausible it looks."""
    return "0.75"


def returns_huge(response: str, answer: str) -> float:
    """Finite in float64, infinite in the float32 the rewards are stored in (negative for '-')."""
    return -1e39 if response.startswith("-") else 1e39


def exits_on_seven(response: str, answer: str) -> float:
    """The worker process exits (code 3) for responses containing '7', else exact match."""
    if "7" in response:
        os._exit(3)
    return float(response == answer)


def killed_on_seven(response: str, answer: str) -> float:
    """The worker process is killed (SIGKILL, as by the OOM killer) for '7', else exact match."""
    if "7" in response:
        os.kill(os.getpid(), signal.SIGKILL)
    return float(response == answer)
