"""The shared-backbone value head (``inputs.values.model: shared``): the composed objective (PPO +
c_v · the ``value_head`` regulariser on ``LossContext.heads``) equals reference/critics.py
``policy_and_value_loss`` in loss and in the gradients of the logits and of the head's values,
under TP (1, 2: logits), DP and micro-batch splits; the run builds the head the objective declares;
unsupported layouts and knobs are refused naming the setting. The real learner (values, loss and
every parameter's gradient through one backward, TP/PP/SP, checkpoint, export) is checked in
tests/learner/shared_head_cases.py."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megarl.methods.critics.shared  # noqa: F401  (registers the value_head regulariser)
from megarl.advantages.estimators import token_rewards
from megarl.batch import unpack
from megarl.learner.heads import HeadLayoutError, align_head, check_heads, is_head_parameter
from megarl.methods.critics.critic import CriticKnobs, build_values, value_targets
from megarl.methods.critics.shared import SharedValues
from megarl.objectives.api import LossContext
from megarl.objectives.rl_objective import ObjectiveConfig, RLObjective, objective_heads
from megarl.testing.equivalence import megarl_loss_and_grad
from reference.advantages import gae as reference_gae
from reference.critics import policy_and_value_loss
from tests.property.strategies import rl_cases
from tests.property.test_advantages import reward_batches

C_V = 0.5
CFG = ObjectiveConfig(
    policy_loss="ppo",
    clip_low=0.2,
    clip_high=0.28,
    regularisers=[{"name": "value_head", "coef": C_V, "value_loss": "clipped", "value_clip": 0.2}],
)


class _WithHead:
    """The run's objective with the head's values of each micro-batch in ``ctx.heads`` (the
    learner's ``micro_batch_context``); the values travel in ``token_extras``."""

    def __init__(self):
        self.objective = RLObjective(CFG)

    def __call__(self, logits, mb, ctx):
        return self.objective(logits, mb, dataclasses.replace(ctx, heads={"value": mb.token_extras["v"]}))


def _reference(case, values: torch.Tensor):
    """reference loss, d/d logits [T, V] and d/d values [T] on the padded batch."""
    b = case.batch
    pad = unpack(b)
    am = pad.attention_mask
    lg = torch.zeros(*am.shape, case.logits.shape[-1], dtype=case.logits.dtype)
    lg[am] = case.logits
    vp = torch.zeros(am.shape, dtype=values.dtype)
    vp[am] = values
    lg.requires_grad_(True)
    vp.requires_grad_(True)
    t = pad.per_token
    loss = policy_and_value_loss(
        lg, pad.tokens, pad.loss_mask, t["advantages"], t["old_logprobs"], vp, t["values"], t["returns"], C_V
    )
    loss.backward()
    return loss.detach(), lg.grad[am], vp.grad[am]


@settings(max_examples=5, deadline=None)
@given(rl_cases(cfgs=st.just(CFG)), st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.integers(1, 3))
def test_policy_plus_value_equals_reference(case, tp, dp, micro):
    b = case.batch
    g = torch.Generator().manual_seed(int(b.tokens.sum()))
    T = b.num_tokens
    b.values = (0.5 * torch.randn(T, generator=g, dtype=torch.float64)).to(case.logits.dtype)
    b.returns = torch.rand(T, generator=g, dtype=torch.float64).to(case.logits.dtype)
    values = b.values + 0.4 * torch.randn(T, generator=g, dtype=torch.float64).to(b.values.dtype)
    ref_loss, ref_glogits, ref_gv = _reference(case, values)
    leaf = values.clone().requires_grad_(True)
    b.token_extras["v"] = leaf
    loss, glogits = megarl_loss_and_grad(case, tp=tp, dp=dp, micro_batches=micro, objective=_WithHead())
    torch.testing.assert_close(loss.double(), ref_loss.double(), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(glogits, ref_glogits, rtol=1e-7, atol=1e-9)
    # every TP rank computes the same (replicated) value term: its gradient arrives once per rank
    torch.testing.assert_close(leaf.grad / tp, ref_gv, rtol=1e-7, atol=1e-9)


@settings(max_examples=8, deadline=None)
@given(reward_batches(), st.sampled_from([1.0, 0.9]), st.sampled_from([0.0, 0.5, 0.95, 1.0]))
def test_decoupled_critic_lambda_targets(b, gamma, lam):
    """``targets: lambda``: the critic regresses on GAE(γ, λ_c) returns over V_old, whatever λ the
    actor's advantages use; λ_c = 1 is the Monte Carlo return."""
    pad = unpack(b)
    am = pad.attention_mask
    r, v = torch.zeros(am.shape, dtype=torch.float64), torch.zeros(am.shape, dtype=torch.float64)
    r[am], v[am] = token_rewards(b), b.values.double()
    _, want = reference_gae(r, v, pad.loss_mask.double(), gamma, lam)
    got = value_targets(b, "lambda", gamma, lam)
    torch.testing.assert_close(got.double(), want[am], rtol=1e-10, atol=1e-10)
    if lam == 1.0:
        torch.testing.assert_close(got, value_targets(b, "monte_carlo", gamma), rtol=1e-10, atol=1e-10)


def test_the_run_builds_the_heads_the_objective_declares():
    assert objective_heads(CFG) == ("value",)
    assert objective_heads(ObjectiveConfig(policy_loss="ppo")) == ()


def test_align_head_and_export_names():
    out = align_head(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 9.0]), torch.tensor([0, 2, 5]))
    assert out.tolist() == [0.0, 1.0, 0.0, 3.0, 4.0]  # value[t] = head(h[t-1]); first tokens 0
    assert is_head_parameter("megarl_heads.value.weight")
    assert not is_head_parameter("output_layer.weight") and not is_head_parameter("decoder.megarl_heads.x")


def test_refusals_name_the_setting():
    lay = types.SimpleNamespace(cp=2)
    with pytest.raises(HeadLayoutError, match="parallel.cp=2"):
        check_heads(("value",), lay, trainable=True)
    with pytest.raises(HeadLayoutError, match="forward-only"):
        check_heads(("value",), types.SimpleNamespace(cp=1), trainable=False)
    with pytest.raises(HeadLayoutError, match="distinct"):
        check_heads(("value", "value"), types.SimpleNamespace(cp=1), trainable=True)
    check_heads((), lay, trainable=False)  # no head: any layout
    for knob, value in (
        ("lr", 1e-2),
        ("value_loss", "mse"),
        ("epochs", 2),
        ("warmup_steps", 1),
        ("context", True),
    ):
        with pytest.raises(ValueError, match=f"inputs.values.{knob}"):
            CriticKnobs(model="shared", **{knob: value}).check()
    CriticKnobs(model="shared", targets="lambda", lam=0.9, whiten_advantages=True).check()
    with pytest.raises(ValueError, match="lam=1.5"):
        CriticKnobs(targets="lambda", lam=1.5).check()

    no_head = types.SimpleNamespace(policy=types.SimpleNamespace(cfg=types.SimpleNamespace(heads=())))
    with pytest.raises(ValueError, match="value_head"):
        SharedValues(no_head, CriticKnobs(model="shared"))
    with_head = types.SimpleNamespace(
        policy=types.SimpleNamespace(cfg=types.SimpleNamespace(heads=("value",)))
    )
    with pytest.raises(ValueError, match="inputs.values.model: shared"):
        build_values(with_head, CriticKnobs(model="critic"))


def test_the_regulariser_refuses_a_learner_without_the_head():
    from megarl.objectives.api import GlobalNormalisers
    from megarl.objectives.regularisers import REGULARISERS

    fn = REGULARISERS.get("value_head")
    b = types.SimpleNamespace(returns=torch.zeros(3), values=torch.zeros(3))
    ctx = LossContext(normalisers=GlobalNormalisers(3.0, 1.0))
    with pytest.raises(ValueError, match="'value' output head"):
        fn(None, None, None, b, ctx)
