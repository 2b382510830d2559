"""Distillation family over real gloo collectives (two spawned processes): as two data-parallel
ranks, the batch-global quantile gates and RSTG's prepare give exactly what the whole batch gives on
one rank; as two tensor-parallel ranks (2 micro-batches), the RSTG, Self-Routing and SKALD losses
and logits gradients equal their references. The simulated tier (tests/unit/test_quantile_gates.py
and the per-method tests) covers the search space; this checks the real transport."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.methods.distillation import rstg
from megarl.objectives.rl_objective import build_objective
from megarl.ops.quantile import global_quantile, top_fraction_mask, top_fraction_threshold
from megarl.testing.equivalence import gather_rank_results
from megarl.testing.gloo_pool import GlooPool
from tests.methods import test_rstg, test_self_routing, test_skald
from tests.methods.test_rstg import _batch
from tests.methods.trust_regions_harness import assert_equivalent
from tests.property.strategies import rl_cases


@pytest.fixture(scope="module")
def gloo2():
    pool = GlooPool(2)
    yield pool
    pool.close()


def quantile_entry(rank, group, payload):
    """GlooPool entry: this rank's share of the values -> (quantile, threshold, mask)."""
    x, cut, q, frac = payload
    mine = x[:cut] if rank == 0 else x[cut:]
    return (
        global_quantile(mine, q, group),
        top_fraction_threshold(mine, frac, group),
        top_fraction_mask(mine, frac, group),
    )


@settings(max_examples=3)
@given(
    vals=st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=1, max_size=40),
    cut=st.integers(0, 40),
    q=st.floats(0, 1),
    frac=st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]),
)
def test_quantile_gates_dp2_equal_dp1(gloo2, vals, cut, q, frac):
    x = torch.tensor(vals, dtype=torch.float64)
    cut = cut % (len(vals) + 1)  # rank 0 may hold nothing or everything
    outs = gloo2.run("tests.methods.test_distillation_gloo:quantile_entry", (x, cut, q, frac))
    want = (global_quantile(x, q), top_fraction_threshold(x, frac), top_fraction_mask(x, frac))
    for o in outs:
        assert torch.equal(o[0], want[0]) and torch.equal(o[1], want[1])
    assert torch.equal(torch.cat([outs[0][2], outs[1][2]]), want[2])


def rstg_entry(rank, group, payload):
    """GlooPool entry: RSTG's prepare on this rank's share of whole groups -> its extras."""
    b, cut, knobs = payload
    share = b.select(range(cut) if rank == 0 else range(cut, b.num_seqs))
    return rstg.prepare(share, group, **knobs).extras


@settings(max_examples=3)
@given(
    seed=st.integers(0, 1000),
    cut=st.sampled_from([0, 2, 4, 6]),
    rho=st.sampled_from([0.1, 0.3, 0.6]),
    rewards=st.lists(st.sampled_from([0.0, 1.0]), min_size=6, max_size=6),
)
def test_rstg_prepare_dp2_equals_dp1(gloo2, seed, cut, rho, rewards):
    b, _ = _batch(rewards, [0, 0, 1, 1, 2, 2], seed=seed)
    knobs = {"rho_entropy": rho, "rho_divergence": rho / 2}
    outs = gloo2.run("tests.methods.test_distillation_gloo:rstg_entry", (b, cut, knobs))
    want = rstg.prepare(b, None, **knobs).extras
    for k, v in want.items():
        assert torch.equal(torch.cat([outs[0][k], outs[1][k]]), v), k


def _over_gloo(pool, case):
    """The objective prepared on the whole batch in the driver, then TP=2 over gloo, 2 micro-batches."""
    b = build_objective(case.cfg).prepare(case.batch, None)
    prepared = dataclasses.replace(case, batch=b)
    return gather_rank_results(pool.run("megarl.testing.equivalence:gloo_case_entry", (prepared, 2, 1, 2)))


@settings(max_examples=2)
@given(data=st.data())
def test_losses_over_gloo_tp2(gloo2, data):
    """RSTG, Self-Routing and SKALD (whose tilted normaliser is a vocab-parallel reduction of its own)
    at TP=2 over real gloo equal their references."""
    for mod in (test_rstg, test_self_routing, test_skald):
        case = data.draw(rl_cases(torch.float64, cfgs=mod.CFGS, vocab_sizes=(8, 12)))
        mod._set_up(case, data, 1)
        assert_equivalent(_over_gloo(gloo2, case), mod._reference(case), case.logits)
