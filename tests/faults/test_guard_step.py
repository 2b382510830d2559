"""The non-finite guard computes the global gradient norm once per step and finishes the optimizer
step with it: the same norm, clipping and weights as megatron-core's own step; a NaN gradient is
still a skipped step that leaves the weights alone."""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.optimizer import optimizer as mopt

from megarl.faults.guard import NonFiniteGuard
from megarl.objectives.rl_objective import build_objective
from tests.learner.test_old_logprobs_reuse import _batch, _learner


def _counting(monkeypatch) -> list:
    calls: list = []
    original = mopt.get_grad_norm_fp32

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(mopt, "get_grad_norm_fp32", counted)
    return calls


def test_guarded_step_equals_the_optimizer_step_with_one_norm(monkeypatch):
    objective = build_objective({"policy_loss": "ppo"})
    # large advantages, so the gradient norm exceeds clip_grad=1.0 and the clip is exercised
    batch = _batch()
    batch = dataclasses.replace(batch, advantages=batch.advantages * 50)
    plain, guarded = _learner(), _learner()
    guard = NonFiniteGuard(guarded).install()
    calls = _counting(monkeypatch)
    m_plain = plain.train_step(batch, objective, 2, old_from_forward=True)
    plain_calls = len(calls)
    m_guard = guarded.train_step(batch, objective, 2, old_from_forward=True)
    assert (plain_calls, len(calls) - plain_calls) == (1, 1)  # was 2 with the guard
    assert m_plain["grad_norm"] > 1.0 and m_plain["grad_clipped"] == 1.0
    assert m_guard["grad_norm"] == m_plain["grad_norm"] == guard.last_norm
    assert m_guard["update_successful"] == 1.0
    for (name, a), b in zip(plain.model.named_parameters(), guarded.model.parameters()):
        assert torch.equal(a, b), name
    guard.uninstall()


def test_guard_skips_a_nan_step():
    learner = _learner()
    guard = NonFiniteGuard(learner).install()
    before = [p.detach().clone() for p in learner.model.parameters()]
    batch = _batch()
    bad = dataclasses.replace(batch, advantages=batch.advantages * float("nan"))
    m = learner.train_step(bad, build_objective({"policy_loss": "ppo"}), 1, old_from_forward=True)
    assert m["update_successful"] == 0.0 and guard.skipped == 1
    for a, b in zip(before, learner.model.parameters()):
        assert torch.equal(a, b)
    guard.uninstall()
