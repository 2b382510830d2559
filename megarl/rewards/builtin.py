"""Built-in verifiers. Both are pure and fast, so they run in the trainer process."""

from __future__ import annotations

import re


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response equals the answer after stripping surrounding whitespace, else 0.0."""
    return float(response.strip() == answer.strip())


def regex_match(response: str, answer: str, pattern: str) -> float:
    """1.0 when ``pattern`` matches the response, with ``{answer}`` in the pattern replaced by the
    escaped answer (e.g. ``"answer is {answer}\\b"``), else 0.0."""
    return float(re.search(pattern.replace("{answer}", re.escape(answer.strip())), response) is not None)
