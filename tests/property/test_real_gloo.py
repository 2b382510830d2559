"""The same equivalence as test_objective_equivalence, over real gloo collectives between
processes (spawned once per session), at TP=2 and TP=4. Smaller example counts: each example
costs a few ms of real all-reduces, and the simulated tier already covers the search space."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.testing.equivalence import gather_rank_results, reference_loss_and_grad
from megarl.testing.gloo_pool import GlooPool, WorkerError
from tests.property.strategies import rl_cases


@pytest.fixture(scope="session")
def gloo2():
    pool = GlooPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def gloo4():
    pool = GlooPool(4)
    yield pool
    pool.close()


def _check(pool, case, tp, dp, mb):
    ref_loss, ref_grad = reference_loss_and_grad(case)
    loss, grad = gather_rank_results(
        pool.run("megarl.testing.equivalence:gloo_case_entry", (case, tp, dp, mb))
    )
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_loss.abs())))
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_grad.abs().max())))


@settings(max_examples=30)
@given(case=rl_cases(torch.float64), dp=st.sampled_from([1, 2]), mb=st.integers(1, 2))
def test_objective_over_real_gloo_tp2(gloo2, case, dp, mb):
    _check(gloo2, case, 2, dp, mb)


@settings(max_examples=10)
@given(case=rl_cases(torch.float64, vocab_sizes=(4, 8, 16)))
def test_objective_over_real_gloo_tp4(gloo4, case):
    _check(gloo4, case, 4, 1, 1)


def test_worker_error_is_reported_with_traceback(gloo2):
    with pytest.raises(WorkerError, match="rank"):
        gloo2.run("megarl.testing.equivalence:gloo_case_entry", ("not a case", 2, 1, 1))
