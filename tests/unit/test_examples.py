"""Every examples/methods/core-*.yaml builds a valid objective and advantage estimator, and the
objective it describes matches the reference at TP=2 on a random batch (prepared first, as the
learner prepares it: batch-normalised corrections and the dropping denominator need it)."""

from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.objectives.rl_objective import build_objective
from megarl.testing.equivalence import megarl_loss_and_grad, reference_loss_and_grad
from tests.property.strategies import rl_cases
from tests.property.test_correction_composition import prepare_on_dp

EXAMPLES = sorted((Path(__file__).parents[2] / "examples" / "methods").glob("core-*.yaml"))


def test_there_are_core_examples():
    assert len(EXAMPLES) >= 10


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_builds_and_matches_reference(path):
    cfg = yaml.safe_load(path.read_text())
    assert set(cfg) <= {"base", "logging", "advantage", "objective", "teacher"}, (
        f"{path.name}: unexpected sections {sorted(cfg)}"
    )
    adv = dict(cfg["advantage"])
    assert adv.pop("estimator") in ADVANTAGE_ESTIMATORS
    objective = build_objective(cfg["objective"])

    @settings(max_examples=10)
    @given(case=rl_cases(torch.float64, cfgs=st.just(objective.cfg)))
    def check(case):
        ref_loss, ref_grad = reference_loss_and_grad(case)
        loss, grad = megarl_loss_and_grad(prepare_on_dp(case, 1), tp=2, micro_batches=2)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_loss.abs())))
        torch.testing.assert_close(
            grad, ref_grad, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_grad.abs().max()))
        )

    check()


def test_unknown_objective_key_is_named():
    with pytest.raises(ValueError, match="unknown objective key.*'clip_hi'"):
        build_objective({"clip_hi": 0.3})


def test_unknown_policy_loss_lists_allowed_values():
    with pytest.raises(ValueError, match="objective.policy_loss=.ppo2.; allowed: .*cispo, .*dppo_kl"):
        build_objective({"policy_loss": "ppo2"})


def test_non_numeric_knob_is_named():
    with pytest.raises(ValueError, match="objective.clip_low='1.0e9' must be a number"):
        build_objective({"clip_low": "1.0e9"})


def test_unknown_regulariser_is_named():
    with pytest.raises(ValueError, match=r"objective.regularisers\[0\].name='nope'"):
        build_objective({"regularisers": [{"name": "nope", "coef": 1.0}]})


def test_registered_regulariser_is_added_to_the_loss():
    from megarl.batch import from_sequences
    from megarl.objectives.api import GlobalNormalisers, LossContext
    from megarl.objectives.regularisers import REGULARISERS

    if "test_logp_sum" not in REGULARISERS:
        REGULARISERS.register("test_logp_sum")(lambda logits, logp, old, batch, ctx, scale=1.0: scale * logp)
    b = from_sequences([[1, 2]], [[3, 0]], [0])
    b.advantages = torch.zeros(4)
    logits = torch.randn(4, 5, dtype=torch.float64)
    ctx = LossContext(GlobalNormalisers(2, 1, 2))
    base = build_objective({})(logits, b, ctx).loss
    with_reg = build_objective({"regularisers": [{"name": "test_logp_sum", "coef": 0.5, "scale": 2.0}]})
    out = with_reg(logits, b, ctx)
    lp = torch.log_softmax(logits, -1)[torch.arange(4), b.tokens]
    torch.testing.assert_close(out.loss - base, 0.5 * 2.0 * (lp * b.loss_mask).sum() / 2)
    assert "reg/test_logp_sum" in out.metrics
