"""Method family 1 over real gloo collectives (two spawned processes, TP=2, 2 micro-batches):
each method's objective, prepared on the whole batch in the driver, equals its reference. The
simulated tier (the per-method tests) covers the search space; this checks the real transport."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.objectives.rl_objective import build_objective
from megarl.testing.equivalence import gather_rank_results
from megarl.testing.gloo_pool import GlooPool
from tests.methods import test_cokl, test_eppo, test_estr, test_gapo, test_output_reset, test_sao
from tests.methods.trust_regions_harness import assert_equivalent
from tests.property.strategies import rl_cases


@pytest.fixture(scope="module")
def gloo2():
    pool = GlooPool(2)
    yield pool
    pool.close()


def _over_gloo(pool, case):
    b = build_objective(case.cfg).prepare(case.batch, None)
    prepared = dataclasses.replace(case, batch=b)
    return gather_rank_results(pool.run("megarl.testing.equivalence:gloo_case_entry", (prepared, 2, 1, 2)))


SIMPLE = {"output_reset": test_output_reset, "estr": test_estr, "sao_clip": test_sao}


@pytest.mark.parametrize("name", sorted(SIMPLE))
def test_elementwise_methods_over_gloo(gloo2, name):
    mod = SIMPLE[name]

    @settings(max_examples=3)
    @given(case=rl_cases(torch.float64, cfgs=mod.CFGS))
    def check(case):
        assert_equivalent(_over_gloo(gloo2, case), mod._reference(case), case.logits)

    check()


@settings(max_examples=3)
@given(case=rl_cases(torch.float64, cfgs=test_gapo.gapo_cfgs()))
def test_gapo_over_gloo(gloo2, case):
    assert_equivalent(_over_gloo(gloo2, case), test_gapo._reference(case), case.logits)


@settings(max_examples=3)
@given(case=rl_cases(torch.float64, cfgs=test_cokl.CFGS, min_group_size=2), data=st.data())
def test_cokl_on_policy_over_gloo(gloo2, case, data):
    correct = test_cokl._set_up(case, data, 1)
    assert_equivalent(_over_gloo(gloo2, case), test_cokl._reference(case, correct), case.logits)


@settings(max_examples=3)
@given(case=rl_cases(torch.float64, cfgs=test_eppo.CFGS), data=st.data())
def test_eppo_first_step_over_gloo(gloo2, case, data):
    case = test_eppo._with_tasks(case, data)
    want, _ = test_eppo._reference_step(case, test_eppo._fresh())
    assert_equivalent(_over_gloo(gloo2, case), want, case.logits)
