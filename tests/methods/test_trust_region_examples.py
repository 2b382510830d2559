"""Every example config of method family 1 builds its objective and advantage estimator, and one
prepared step on a random batch (TP=2, 2 micro-batches) gives a finite loss and gradient."""

from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.objectives.rl_objective import build_objective
from tests.methods.trust_regions_harness import megarl_method_loss_and_grad
from tests.property.strategies import rl_cases

DIR = Path(__file__).parents[2] / "examples" / "methods"
NAMES = ["output-reset", "cokl", "gapo", "estr", "sao", "eppo"]


@pytest.mark.parametrize("name", NAMES)
def test_example_builds_and_runs(name):
    cfg = yaml.safe_load((DIR / f"{name}.yaml").read_text())
    core = {"base", "logging", "advantage", "objective"}
    # SAO composes a value model (method/inputs) and one rollout per prompt (rollout/schedule)
    extra = {"method", "inputs", "rollout", "schedule"} if name == "sao" else set()
    assert core <= set(cfg) <= core | extra, f"{name}.yaml: sections {sorted(cfg)}"
    adv = dict(cfg["advantage"])
    assert adv.pop("estimator") in ADVANTAGE_ESTIMATORS
    objective = build_objective(cfg["objective"])

    @settings(max_examples=3, suppress_health_check=[HealthCheck.too_slow])
    @given(case=rl_cases(torch.float64, cfgs=st.just(objective.cfg)))
    def check(case):
        b = case.batch
        b.task_ids = torch.arange(b.num_seqs) % 2
        b.entropies = torch.rand(b.num_tokens, dtype=torch.float64)
        loss, grad = megarl_method_loss_and_grad(case, tp=2, micro_batches=2)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()

    check()
