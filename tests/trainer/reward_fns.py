"""Reward functions used by tests/trainer (imported by path in the contained worker)."""

import time


def length_is_answer(response: str, answer: str) -> float:
    """1.0 when the response has as many characters as the answer."""
    return float(len(response.strip()) == len(answer.strip()))


def raises_on_seven(response: str, answer: str) -> float:
    """Raises for responses containing '7', else exact match."""
    if "7" in response:
        raise RuntimeError("seven is not allowed")
    return float(response == answer)


def hangs_on_seven(response: str, answer: str, sleep_s: float = 60.0) -> float:
    """Sleeps ``sleep_s`` for responses containing '7' (a hung verifier), else exact match."""
    if "7" in response:
        time.sleep(sleep_s)
    return float(response == answer)


def returns_nan(response: str, answer: str) -> float:
    return float("nan")
