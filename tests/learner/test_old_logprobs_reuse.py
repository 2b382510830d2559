"""On-policy old-logprob reuse: one optimizer step whose old logprobs are the training forward's,
detached, gives the same loss, gradient norm, metrics and updated weights as recomputing them with
a second forward; the trainer takes that path only where it is exact."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megarl.batch import PackedBatch
from megarl.learner.learner import Learner, LearnerConfig, OptimConfig
from megarl.learner.parallel import ParallelLayout, initialize_parallel
from megarl.objectives.rl_objective import build_objective
from megarl.testing.tiny_qwen3 import TINY_QWEN3_HF
from megarl.trainer.config_loading import load_config
from megarl.trainer.method_runtime import old_logprobs_from_forward, required_inputs
from tests.learner.dist_cases import make_batch

ROOT = Path(__file__).parents[2]
VOCAB = 48
HF = dict(
    TINY_QWEN3_HF,
    vocab_size=VOCAB,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


def _learner() -> Learner:
    groups = initialize_parallel(ParallelLayout())
    return Learner(LearnerConfig(hf_config=HF, optim=OptimConfig(lr=1e-2, clip_grad=1.0), seed=7), groups)


def _batch() -> PackedBatch:
    # an engine's logprobs, off the learner's: the objective must not fall back to them
    return make_batch(5, (9, 6, 11, 6, 8, 5), vocab=VOCAB, rollout_logprobs=True)


def test_reused_old_logprobs_give_the_recomputed_update():
    objective = build_objective({"policy_loss": "ppo", "clip_low": 0.2, "clip_high": 0.2})
    batch = _batch()
    for micro in (1, 3):
        recomputing, reusing = _learner(), _learner()
        for a, b in zip(recomputing.model.parameters(), reusing.model.parameters()):
            assert torch.equal(a, b)  # same seed, same initial weights
        old, _ = recomputing.compute_logprobs(batch, micro)
        m_old = recomputing.train_step(dataclasses.replace(batch, old_logprobs=old), objective, micro)
        m_new = reusing.train_step(batch, objective, micro, old_from_forward=True)
        assert m_old.keys() == m_new.keys()
        for k in m_old:
            assert m_old[k] == m_new[k], (micro, k)  # loss, grad_norm, ratio, clip stats: bit for bit
        # exactly 1: the objective took neither batch.old_logprobs (None) nor the engine's logprobs
        assert m_new["ratio_mean"] == 1.0
        for (name, a), b in zip(recomputing.model.named_parameters(), reusing.model.parameters()):
            assert torch.equal(a, b), (micro, name)


def test_objectives_without_support_are_refused():
    class Plain:
        def __call__(self, logits, batch, ctx):
            raise AssertionError("not reached")

    with pytest.raises(ValueError, match="Plain does not take old logprobs from the training forward"):
        _learner().train_step(_batch(), Plain(), 1, old_from_forward=True)


def _reuses(*overrides: str, spec=None, advantage: dict | None = None) -> bool:
    cfg = load_config(ROOT / "examples/quickstart.yaml", list(overrides))
    if advantage is not None:
        cfg.advantage.estimator, cfg.advantage.knobs = advantage["estimator"], advantage["knobs"]
    return old_logprobs_from_forward(cfg, required_inputs(cfg, spec), spec)


def test_reuse_only_where_exact():
    assert _reuses()  # the quickstart: one epoch, one mini-batch, core parts
    assert _reuses("schedule.micro_batches=4")  # gradient accumulation: the same weights
    assert not _reuses("schedule.ppo_epochs=2")
    assert not _reuses("schedule.mini_batches=2")
    assert not _reuses("schedule.old_logprobs=rollout")
    assert not _reuses("objective.correction=tis")
    assert not _reuses("faults.inject=[{kind: poison, field: tokens, fraction: 0.3, step: 2}]")
    assert _reuses(advantage={"estimator": "reinforce_pp", "knobs": {"kl_coef": 0.0}})
    assert not _reuses(advantage={"estimator": "reinforce_pp", "knobs": {"kl_coef": 0.1}})
    assert not _reuses(spec=SimpleNamespace(name="m", inputs=()))  # a method's parts may read them
