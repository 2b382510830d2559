"""Batch-global quantile gates (megarl/ops/quantile.py): with the values split over 1-3 simulated
data-parallel ranks (uneven shares, empty ones included) the thresholds and masks equal those of the
whole batch on one rank exactly, and the top-fraction gate keeps the requested count."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.ops.quantile import global_quantile, top_count, top_fraction_mask, top_fraction_threshold
from megarl.testing.simulated_group import SimulatedWorld

VALUES = st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=1, max_size=30)


def _shares(n, cuts):
    bounds = sorted({0, n, *[c % (n + 1) for c in cuts]})
    return list(itertools.pairwise(bounds))


@settings(max_examples=10)
@given(vals=VALUES, cuts=st.lists(st.integers(0, 40), max_size=2), q=st.floats(0, 1), frac=st.floats(0, 1))
def test_split_over_ranks_equals_one_rank(vals, cuts, q, frac):
    x = torch.tensor(vals, dtype=torch.float64)
    shares = _shares(len(vals), cuts)
    whole = (global_quantile(x, q), top_fraction_threshold(x, frac), top_fraction_mask(x, frac))
    outs = SimulatedWorld(len(shares)).run(
        lambda r, g: (
            global_quantile(x[slice(*shares[r])], q, g),
            top_fraction_threshold(x[slice(*shares[r])], frac, g),
            top_fraction_mask(x[slice(*shares[r])], frac, g),
        )
    )
    for o in outs:
        assert torch.equal(o[0], whole[0]) and torch.equal(o[1], whole[1])
    assert torch.equal(torch.cat([o[2] for o in outs]), whole[2])
    torch.testing.assert_close(whole[0], torch.quantile(x, q), rtol=0, atol=0)


@settings(max_examples=15)
@given(n=st.integers(1, 40), frac=st.floats(0, 1), seed=st.integers(0, 1000))
def test_distinct_values_keep_exactly_ceil_frac_n(n, frac, seed):
    x = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).double()
    kept = top_fraction_mask(x, frac)
    assert int(kept.sum()) == math.ceil(frac * n - 1e-9)
    if kept.any() and not kept.all():
        assert float(x[kept].min()) > float(x[~kept].max())


def test_ties_at_the_threshold_are_all_kept_and_zero_keeps_nothing():
    x = torch.tensor([1.0, 2.0, 2.0, 2.0, 3.0])
    assert top_fraction_mask(x, 0.4).tolist() == [False, True, True, True, True]
    assert not top_fraction_mask(x, 0.0).any() and top_fraction_mask(x, 1.0).all()
    assert top_count(10, 0.1 * 3) == 3  # 0.30000000000000004 · 10 is 3, not 4


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="q=1.5"):
        global_quantile(torch.ones(3), 1.5)
    with pytest.raises(ValueError, match="no values"):
        global_quantile(torch.ones(0), 0.5)
    with pytest.raises(ValueError, match="top fraction"):
        top_fraction_mask(torch.ones(3), -0.1)
    with pytest.raises(ValueError, match="1-D"):
        SimulatedWorld(2).run(lambda r, g: top_fraction_mask(torch.ones(2, 2), 0.5, g))
