"""Shared checks of the family-2 method tests: example configs and loss/gradient equivalence."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
import yaml

import megarl.methods.credit  # noqa: F401  (registers the estimators and the taco policy loss)
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.objectives.rl_objective import build_objective
from megarl.testing.equivalence import Case, megarl_loss_and_grad, reference_loss_and_grad

EXAMPLES = Path(__file__).parents[2] / "examples" / "methods"


def load_example(name: str) -> dict:
    """Load examples/methods/NAME.yaml and check every section: the estimator and its knobs (as the
    trainer does), the objective (built), and the reward-shaping section (built)."""
    cfg = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    method_sections = {"advantage", "objective", "reward", "inputs", "environment", "method"}
    # besides its method's sections, an example names its base config and its own run directory
    assert set(cfg) <= method_sections | {"base", "logging"}, (
        f"{name}.yaml: unexpected sections {sorted(cfg)}"
    )
    assert cfg.get("base") == "../quickstart.yaml", f"{name}.yaml: base {cfg.get('base')!r}"
    adv = dict(cfg["advantage"])
    est = adv.pop("estimator")
    fn = ADVANTAGE_ESTIMATORS.get(est)
    params = inspect.signature(fn).parameters
    for k, v in adv.items():
        assert k in params, f"{name}.yaml: advantage.{k} is not a knob of {est}"
        d = params[k].default
        assert isinstance(v, type(d)) or (isinstance(d, float) and isinstance(v, int)), (k, v, d)
    build_objective(cfg["objective"])
    if "reward" in cfg:
        from megarl.rewards.shaping import build_reward_shaping

        build_reward_shaping(cfg["reward"])
    return cfg


def assert_objective_equivalent(
    case: Case, tp: int, micro_batches: int = 2, objective=None, reference=reference_loss_and_grad
) -> None:
    """megarl (packed, TP-sharded, micro-batched) loss and logits gradient equal the reference's."""
    ref_loss, ref_grad = reference(case)
    loss, grad = megarl_loss_and_grad(
        case, tp=tp, micro_batches=min(micro_batches, case.batch.num_seqs), objective=objective
    )
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_loss.abs())))
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_grad.abs().max())))


def example_objective(name: str):
    """The ObjectiveConfig of examples/methods/NAME.yaml."""
    from megarl.objectives.rl_objective import ObjectiveConfig

    return ObjectiveConfig(**load_example(name)["objective"])


def velocity_model(seed: int):
    """The tiny float64 velocity MLP of the flow-method tests, its weights drawn from ``seed``."""
    from megarl.methods.gradients import flow_model as fm

    torch.manual_seed(seed)
    return fm.VelocityMLP(hidden=8, layers=2, freqs=2).double()


def assert_splits_add_up(loss: torch.Tensor, grads, params, part_losses) -> None:
    """The per-part losses (each already normalised by the whole batch), summed, and the sum of their
    gradients equal the whole batch's ``loss`` and ``grads``: micro-batch / data-parallel splits add up."""
    params = list(params)
    acc = [torch.zeros_like(p) for p in params]
    total = torch.zeros((), dtype=torch.float64)
    for lp in part_losses:
        for s, g in zip(acc, torch.autograd.grad(lp, params)):
            s += g
        total = total + lp.detach()
    torch.testing.assert_close(total, loss.detach(), rtol=1e-12, atol=1e-14)
    for s, g in zip(acc, grads):
        torch.testing.assert_close(s, g, rtol=1e-10, atol=1e-13)
