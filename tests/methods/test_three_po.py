"""3PO: its loss equals reference/perturbation.py (loss and logits gradient; TP 1 and 2, micro-batch
and DP splits), σ → 0 gives GRPO's loss exactly, every sync runs inside the hook's perturbation
and the learner keeps θ, ids are reproducible and stamped on every sample, the zero-advantage
fraction is computable."""

import asyncio
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.perturbation as rp
from megarl.advantages.estimators import grpo
from megarl.batch import unpack
from megarl.convert.plan import Entry
from megarl.methods.gradients.perturbation import WeightPerturbation, param_noise_map
from megarl.methods.gradients.three_po import (
    PerturbationIds,
    PerturbedRollouts,
    ThreePOKnobs,
    check_sync_loop,
    perturbation_id,
)
from megarl.plugin.knobs import build_knobs
from megarl.plugin.rounds import RolloutRound
from megarl.testing.equivalence import megarl_loss_and_grad
from tests.methods.helpers import load_example
from tests.property.strategies import rl_cases


def _three_po_cfg(case, cap):
    return dataclasses.replace(
        case.cfg,
        policy_loss="ppo",
        correction="tis",
        correction_high=cap,
        kl_coef=0.0,
        entropy_coef=0.0,
        distill="none",
        distill_coef=0.0,
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=None,
        regularisers=[],
        policy_loss_args={},
    )


def _reference(case, cap):
    pad = unpack(case.batch)
    V = case.logits.shape[-1]
    full = torch.zeros(pad.attention_mask.shape + (V,), dtype=case.logits.dtype)
    full[pad.attention_mask] = case.logits
    full.requires_grad_(True)
    tok = pad.per_token
    cfg = case.cfg
    loss = rp.three_po_loss(
        full,
        pad.tokens,
        pad.loss_mask,
        tok["advantages"],
        tok["old_logprobs"],
        tok["rollout_logprobs"],
        cfg.clip_low,
        cfg.clip_high,
        cap,
        cfg.aggregation,
    )
    loss.backward()
    return loss.detach(), full.grad[pad.attention_mask]


@settings(max_examples=5)
@given(
    case=rl_cases(torch.float64),
    cap=st.sampled_from([1.5, 2.0, 5.0]),
    tp=st.sampled_from([1, 2]),
    split=st.sampled_from([(1, 1), (1, 2), (2, 1)]),
)
def test_loss_and_gradient_equal_the_reference(case, cap, tp, split):
    case.cfg = _three_po_cfg(case, cap)
    if case.cfg.aggregation == "seq-mean-token-sum-norm":
        case.cfg = dataclasses.replace(case.cfg, aggregation="token-mean")
    if case.logits.shape[-1] % tp:
        tp = 1
    dp, micro = split
    loss, grad = megarl_loss_and_grad(case, tp, dp, micro)
    ref_loss, ref_grad = _reference(case, cap)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_loss.abs())))
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_grad.abs().max())))


@settings(max_examples=5)
@given(case=rl_cases(torch.float64), cap=st.sampled_from([1.5, 2.0]))
def test_sigma_zero_behaviour_equals_old_gives_grpo_loss_exactly(case, cap):
    """σ = 0: the engine's policy is θ_old, the truncated IS weight is 1 and the loss is GRPO's."""
    case.batch.rollout_logprobs = case.batch.old_logprobs.clone()
    case.cfg = _three_po_cfg(case, cap)
    loss, grad = megarl_loss_and_grad(case, 1)
    case.cfg = dataclasses.replace(case.cfg, correction="none")
    g_loss, g_grad = megarl_loss_and_grad(case, 1)
    assert torch.equal(loss, g_loss) and torch.equal(grad, g_grad)


def _hook(sigma, w):
    p = torch.nn.Parameter(w.clone(), requires_grad=False)
    pert = WeightPerturbation([param_noise_map(Entry("w", ("w",), "replicated", 0), p, None, 1, 0)])
    return PerturbedRollouts(pert, ThreePOKnobs(sigma=sigma, seed=4)), p


def test_sync_runs_inside_the_perturbation_and_the_learner_keeps_theta(monkeypatch):
    import megarl.trainer.weights as tw

    w = torch.randn(64)
    hook, p = _hook(0.1, w)
    seen = []
    monkeypatch.setattr(tw, "push_weights", lambda run, version: seen.append((version, p.data.clone())))
    run = type("R", (), {"method": type("M", (), {"step_hooks": [hook]})()})()
    tw.sync_weights(run, 5)
    ((version, pushed),) = seen
    assert version == 5
    assert torch.equal(pushed, rp.perturb_state({"w": w}, perturbation_id(4, 5), 0.1)["w"])
    assert torch.equal(p.data, w)  # restored bit for bit after the push
    monkeypatch.setattr(tw, "push_weights", lambda run, version: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        tw.sync_weights(run, 6)
    assert torch.equal(p.data, w) and hook.perturbation.active is None  # restored on a failed push too


def test_sigma_zero_pushes_theta_bit_for_bit():
    w = torch.tensor([-0.0, 1e-40, 0.5, -3.0])
    hook, p = _hook(0.0, w)
    with hook.rollout_weights(3):
        assert torch.equal(p.data.view(torch.int32), w.view(torch.int32))


def test_every_sample_carries_the_id_of_the_weights_that_generated_it():
    knobs = ThreePOKnobs(sigma=0.1, seed=4)
    r = RolloutRound(
        ["a", "b"], ["1", "2"], [0, 1], [[1], [2]], [[1]] * 6, ["x"] * 6, {}, torch.zeros(6), 3, 8, 0
    )
    out = asyncio.run(PerturbationIds(knobs).process(r))
    assert out.extras["perturbation_id"] == [float(perturbation_id(4, 7))] * 6  # step 8 <- sync of version 7
    assert perturbation_id(4, 7) == perturbation_id(4, 7) != perturbation_id(4, 8) != perturbation_id(5, 8)
    assert 0 <= perturbation_id(4, 7) < 2**31


def test_zero_advantage_fraction_is_the_share_of_groups_grpo_gives_zero():
    rewards = torch.tensor([1.0, 1, 1, 0, 1, 0, 0, 0, 0.5, 0.5])
    gids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 3])
    adv = grpo(rewards, gids)
    zero_groups = sum(int(bool((adv[gids == g] == 0).all())) for g in range(4))
    assert rp.zero_advantage_fraction(rewards, gids) == zero_groups / 4 == 0.75


def test_knobs_and_loop_are_checked():
    with pytest.raises(ValueError, match="method.sigma"):
        build_knobs(ThreePOKnobs, {"sigma": -1.0}, "method")
    cfg = type("C", (), {"async_loop": type("A", (), {"enabled": True})()})()
    with pytest.raises(ValueError, match="async_loop.enabled"):
        check_sync_loop(cfg, "3po")


def test_example_is_grpo_with_truncated_is():
    cfg = load_example("3po")
    assert cfg["method"]["name"] == "3po" and cfg["advantage"]["estimator"] == "grpo"
    assert cfg["objective"]["correction"] == "tis" and cfg["method"]["sigma"] > 0
