"""The reward floor's n-gram precision at hand-counted points: matched n-grams (with multiplicity)
over the response's len − n + 1 n-grams, n shrinking to the response length."""

import pytest

from megarl.rewards.shaping.reward_floor import ngram_precision

SRC = "the cat sat on the mat".split()


@pytest.mark.parametrize(
    "response, n, want",
    [
        ("the cat sat", 2, 1.0),  # bigrams (the cat), (cat sat): both in the source
        ("the cat ran on the mat", 2, 3 / 5),  # of 5 bigrams, (the cat), (on the), (the mat) match
        ("the cat ran on the mat", 3, 1 / 4),  # of 4 trigrams only (on the mat)
        ("the the the", 1, 1.0),  # multiplicity: each "the" counts
        ("mat the", 3, 0.0),  # n shrinks to 2: (mat the) is not in the source
        ("cat sat", 5, 1.0),  # n shrinks to 2: (cat sat) is
        ("", 3, 0.0),
    ],
)
def test_ngram_precision_by_hand(response, n, want):
    assert ngram_precision(response.split(), SRC, n) == pytest.approx(want, abs=1e-15)
