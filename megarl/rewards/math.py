"""Math answers checked with the ``math-verify`` package (Hugging Face): the final answer of the
response (last ``\\boxed{}``, LaTeX or plain expression) equals the ground truth mathematically
(``1/2`` = ``0.5`` = ``\\frac{1}{2}``, sets, intervals, ...).

Runs inside the contained reward worker (``megarl.rewards.sandbox``): sympy can hang on adversarial
input, and math-verify's own timeouts use SIGALRM, which works only in a process's main thread.
"""

from __future__ import annotations


def math_verify_reward(response: str, answer: str, **kwargs) -> float:
    """1.0 when ``response``'s final answer is mathematically equal to ``answer``, else 0.0.

    ``kwargs`` go to ``math_verify.verify`` (e.g. ``float_rounding``, ``strict``). A ground truth
    with no parsable answer raises ``ValueError`` (a data problem: counted and given the fallback).
    """
    from math_verify import parse, verify

    gold = parse(answer)
    if not gold:
        raise ValueError(f"ground truth {answer!r} has no parsable answer")
    pred = parse(response)
    return float(bool(pred) and verify(gold, pred, **kwargs))
