"""TACO over real gloo collectives (two spawned processes, TP=2, 2 micro-batches): the ``taco`` loss
and its logits gradient equal the reference. The simulated tier (test_taco.py) covers the search
space; this checks the real transport of the entropy and log-prob reductions the weights depend on."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.testing.equivalence import gather_rank_results
from megarl.testing.gloo_pool import GlooPool
from tests.methods.test_taco import taco_reference
from tests.property.strategies import rl_cases


@pytest.fixture(scope="module")
def gloo2():
    pool = GlooPool(2)
    yield pool
    pool.close()


@settings(max_examples=4)
@given(
    case=rl_cases(torch.float64, vocab_sizes=(8, 12, 16)),
    base=st.sampled_from(["ppo", "cispo"]),
    lam=st.sampled_from([0.5, 0.9]),
)
def test_taco_over_gloo(gloo2, case, base, lam):
    case.cfg = dataclasses.replace(
        case.cfg, policy_loss="taco", policy_loss_args={"base": base, "alpha": 0.3, "lam": lam}
    )
    loss, grad = gather_rank_results(gloo2.run("megarl.testing.equivalence:gloo_case_entry", (case, 2, 1, 2)))
    ref_loss, ref_grad = taco_reference(0.3, lam)(case)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_loss.abs())))
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_grad.abs().max())))
