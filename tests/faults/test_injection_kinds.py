"""Faults on the real megatron learner (one process, a 4-expert MoE): one routed expert's weights
made non-finite for one step (``expert``, ``where: weight``; put back afterwards), an LR spike
(``kind: lr``; the scheduler's rate back afterwards), and the replay's expert-id translation
through a proxy's prune report. The expert's rank selection under EP=2 runs in
tests/faults/test_compare_layout.py (torchrun)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megarl.faults.config import FaultsConfig, InjectionConfig, validate_faults
from megarl.faults.injection import InjectionError, Injector
from megarl.learner.learner import Learner, LearnerConfig, OptimConfig
from megarl.learner.parallel import ParallelLayout, initialize_parallel
from megarl.objectives.rl_objective import build_objective
from megarl.proxy.expert_map import ExpertMapError, map_expert_injections
from megarl.testing.tiny_qwen3 import TINY_QWEN3_HF
from tests.learner.dist_cases import make_batch

VOCAB = 48
HF = dict(
    TINY_QWEN3_HF,
    model_type="qwen3_moe",
    vocab_size=VOCAB,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)
LAYER = "decoder.layers.0.mlp"


@pytest.fixture(scope="module")
def learner() -> Learner:
    groups = initialize_parallel(ParallelLayout())
    return Learner(LearnerConfig(hf_config=HF, optim=OptimConfig(lr=1e-3, clip_grad=1.0), seed=7), groups)


def _weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters()}


def _step(learner: Learner) -> dict:
    batch = make_batch(5, (9, 6, 11, 6, 8, 5), vocab=VOCAB, rollout_logprobs=True)
    return learner.train_step(batch, build_objective({"policy_loss": "ppo"}), 1, old_from_forward=True)


def test_nan_in_one_experts_weights_for_one_step(learner):
    from megarl.faults.guard import NonFiniteGuard

    spec = InjectionConfig(kind="nan", target=LAYER, expert=2, where="weight", fraction=1.0, step=1)
    inj = Injector(learner.model, [spec], optimizer=learner.optimizer)
    assert inj.expert_module(spec) == f"{LAYER}.experts.local_experts.2"
    before = _weights(learner)
    guard = NonFiniteGuard(learner).install()
    try:
        assert inj.arm(1) == [spec]
        for n, p in learner.model.named_parameters():
            hit = n.startswith(f"{LAYER}.experts.local_experts.2.")
            assert bool(torch.isnan(p).all()) == hit and bool(torch.isnan(p).any()) == hit, n
        m = _step(learner)
        inj.disarm()
    finally:
        guard.uninstall()
    assert m["update_successful"] == 0.0 and m["grad_norm"] != m["grad_norm"]  # NaN: skipped
    for n, p in learner.model.named_parameters():
        assert torch.equal(p, before[n]), n  # every weight back, bit for bit


def test_an_expert_the_layer_lacks_or_a_non_moe_target_is_refused(learner):
    with pytest.raises(InjectionError, match=r"expert=7: the layer decoder.layers.0.mlp has 4 routed"):
        Injector(learner.model, [InjectionConfig(kind="nan", target=LAYER, expert=7)])
    with pytest.raises(InjectionError, match="not a MoE layer"):
        Injector(
            learner.model, [InjectionConfig(kind="inf", target="decoder.layers.0.self_attention", expert=1)]
        )
    bad = FaultsConfig(inject=[InjectionConfig(kind="nan", target=LAYER, expert=1, where="grad")])
    with pytest.raises(ValueError, match=r"faults.inject\[0\].expert with where: grad"):
        validate_faults(bad)


def test_lr_spike_scales_the_steps_rate_and_gives_the_scheduled_one_back(learner):
    spec = InjectionConfig(kind="lr", scale=1000.0, step=1)
    inj = Injector(learner.model, [spec], optimizer=learner.optimizer)
    lr0 = [g["lr"] for g in learner.optimizer.param_groups]
    before = _weights(learner)
    inj.arm(1)
    m = _step(learner)
    inj.disarm()
    assert m["lr"] == lr0[0] * 1000.0
    assert [g["lr"] for g in learner.optimizer.param_groups] == lr0  # constant schedule: same rate
    # Adam's first step moves each weight by ~lr: 1000x the scheduled rate moves them ~1000x more
    moved = max(float((p - before[n]).abs().max()) for n, p in learner.model.named_parameters())
    assert moved > 100 * lr0[0]
    # a skipped update (no scheduler step) must not leave the spiked rate behind either
    inj.arm(1)
    for g in learner.optimizer.param_groups:
        assert g["lr"] == lr0[0] * 1000.0
    inj.disarm()
    assert [g["lr"] for g in learner.optimizer.param_groups] == lr0
    with pytest.raises(InjectionError, match="needs the learner's optimizer"):
        Injector(learner.model, [spec])


def test_replay_translates_a_faulty_expert_into_the_proxys_numbering(tmp_path):
    report = {
        "layers": [
            {
                "layer": 0,
                "kept": [1, 6],
                "clusters": [[0, 1, 2, 3], [4, 5, 6, 7]],
                "new_index": {"1": 0, "6": 1},
            }
        ]
    }
    (tmp_path / "proxy_report.json").write_text(json.dumps(report))
    spec = InjectionConfig(kind="nan", target=LAYER, expert=6, where="weight", step=3)
    (mapped,), notes = map_expert_injections([spec], tmp_path)
    assert mapped == dataclasses.replace(spec, expert=1) and "proxy expert 1" in notes[0]
    with pytest.raises(
        ExpertMapError, match=r"pruned it \(its cluster is represented by expert 6, proxy expert 1"
    ):
        map_expert_injections([dataclasses.replace(spec, expert=5)], tmp_path)
    assert map_expert_injections([spec], tmp_path / "none") == ([spec], [])  # not a proxy: as recorded


def test_replay_uses_the_recorded_spiked_rate_and_without_injection_the_scheduled_one():
    from megarl.proxy.replay import replay_lr

    recorded = [InjectionConfig(kind="lr", scale=1000.0, step=8), InjectionConfig(kind="nan", step=8)]
    assert replay_lr(1.0, recorded, 8, inject=True) == 1.0
    assert replay_lr(1.0, recorded, 8, inject=False) == 1.0e-3
    assert replay_lr(1.0e-3, recorded, 9, inject=False) == 1.0e-3  # no spike at that step


def test_the_savings_benchmarks_faults_load_as_a_run_config():
    """benchmarks/proxy_savings.py's three faults, as the recipe override it passes."""
    import importlib.util
    from pathlib import Path

    from megarl.trainer.config_loading import load_config

    root = Path(__file__).parents[2]
    spec = importlib.util.spec_from_file_location("proxy_savings", root / "benchmarks" / "proxy_savings.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = root / "megarl" / "testing" / "data" / "tiny-qwen3"  # the recipe needs one; not loaded
    cfg = load_config(
        root / "tests" / "faults" / "recipe.yaml",
        [f"model.hf_dir={model}", bench.injections(5, 4, 6, 8, 1000.0)],
    )
    validate_faults(cfg.faults)
    got = [(s.kind, s.step, s.where, s.expert, s.scale) for s in cfg.faults.inject]
    assert got == [
        ("poison", 4, "output", -1, 1.0),
        ("nan", 6, "weight", 5, 1.0),
        ("lr", 8, "output", -1, 1000.0),
    ]
    layer0 = {"layer": 0, "kept": [3, 40, 61], "new_index": {"3": 0, "40": 1, "61": 2}}
    assert bench.faulty_expert({"layers": [layer0]}) == (61, 2)
