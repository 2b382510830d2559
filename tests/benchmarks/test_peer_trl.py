"""The peer benchmark against TRL (benchmarks/peers/): both sides get the same hyperparameters, its
figures are computed as documented, and a 10-step run of it works end to end (that one needs the TRL
venv, which `make setup` installs; set up with MEGARL_SKIP_TRL_SETUP=1, the smoke skips, saying so)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.trainer.config_loading import load_config

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "benchmarks/peers"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, PEERS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(**kw) -> argparse.Namespace:
    base = dict(prompts=16, n=8, max_new_tokens=4, lr=1e-4, clip=0.2, steps=30, seed=0)
    base.update(eval_every=10, eval_samples=200, eval_k=4)
    return argparse.Namespace(**{**base, **kw})


def test_megarl_and_trl_get_the_same_hyperparameters(tmp_path):
    compare, trl = _module("compare_trl"), _module("trl_grpo")
    a = _args(lr=3e-4, clip=0.25, n=4, prompts=6, max_new_tokens=5)
    cfg = load_config(ROOT / "examples/quickstart.yaml", compare.rl_overrides(a, tmp_path, 7, tmp_path / "r"))
    g = trl.grpo_args(a, str(tmp_path))
    o, s, r = cfg.optimizer, cfg.schedule, cfg.rollout
    assert (o.lr, cfg.objective.clip_low, cfg.objective.clip_high) == (
        g["learning_rate"],
        g["epsilon"],
        g["epsilon_high"],
    )
    assert (r.n, r.max_new_tokens, s.prompts_per_step * r.n) == (
        g["num_generations"],
        g["max_completion_length"],
        g["per_device_train_batch_size"],
    )
    assert (r.temperature, r.top_p) == (g["temperature"], g["top_p"]) and r.top_k == -1 and g["top_k"] == 0
    assert cfg.objective.kl_coef == g["beta"] == 0.0
    assert cfg.objective.aggregation == "token-mean" and g["loss_type"] == "dapo"
    assert cfg.advantage.estimator == "grpo" and cfg.advantage.knobs["scale_by_std"] is True
    assert g["scale_rewards"] == "group"
    assert (s.ppo_epochs, s.mini_batches, s.micro_batches) == (1, 1, 1)
    assert g["num_iterations"] == g["steps_per_generation"] == g["gradient_accumulation_steps"] == 1
    assert (o.clip_grad, o.weight_decay, o.adam_beta1, o.adam_beta2, o.adam_eps) == (
        g["max_grad_norm"],
        g["weight_decay"],
        g["adam_beta1"],
        g["adam_beta2"],
        g["adam_epsilon"],
    )
    assert o.lr_warmup_steps == g["warmup_steps"] == 0
    assert o.lr_decay_steps == 0 and g["lr_scheduler_type"] == "constant"
    assert cfg.warmup.sft_steps == 0 and cfg.model.hf_dir == str(tmp_path)
    assert (s.steps, s.seed, s.eval_every) == (30, 7, 10)


def test_time_to_target_sums_step_times_up_to_the_first_evaluation_reaching_it():
    compare = _module("compare_trl")
    steps = [{"step": i, "wall_s": 0.5 if i == 1 else 0.25} for i in range(1, 31)]
    run = compare.finish(
        {"cpu_s": 9.0, "wall_s": 12.0, "peak_rss_mib": 100.0, "vol_ctx": 5, "threads": {}},
        steps,
        [0.1, 0.2, 0.3],
        [
            {"step": 0, "eval/sampled_acc": 0.2},
            {"step": 10, "eval/sampled_acc": 0.55},
            {"step": 20, "eval/sampled_acc": 0.4},
        ],
    )
    assert run["s_per_step"] == 0.25 and run["cpu_per_step"] == 0.2  # step 1 is left out of the median
    assert compare.time_to(run, 0.5) == pytest.approx(0.5 + 9 * 0.25)
    assert compare.time_to(run, 0.6) is None
    assert compare.time_to(run, 0.1) == 0.0  # the initial policy already reaches it
    other = compare.finish(
        {"cpu_s": 1, "wall_s": 1, "peak_rss_mib": 300.0, "vol_ctx": 9, "threads": {}}, steps, [0.4], []
    )
    both = compare.summary([run, {**other, "curve": {0: 0.3, 10: 0.45}}], 0.5)
    assert both["peak_rss_mib"] == 300.0 and both["reached"] == 1
    assert both["curve"] == {0: [0.2, 0.3], 10: [0.55, 0.45]}


TRL_PYTHON = ROOT / ".venv-trl/bin/python"


@pytest.mark.slow
@pytest.mark.skipif(
    not TRL_PYTHON.exists(),
    reason="no TRL venv (.venv-trl): `make setup` (without MEGARL_SKIP_TRL_SETUP=1) or `make setup-trl`",
)
def test_ten_steps_of_the_peer_benchmark(tmp_path):
    """The benchmark end to end at its smallest: three processes (the shared start's warm-up run,
    10 megarl steps, 10 TRL steps), one seed, evaluations of 8 held-out prompts x 2 samples."""
    out = tmp_path / "figures.json"
    cmd = [sys.executable, str(PEERS / "compare_trl.py"), "--steps", "10", "--seeds", "1"]
    cmd += ["--warmup-steps", "2", "--eval-every", "5", "--eval-samples", "8", "--eval-k", "2"]
    cmd += ["--workdir", str(tmp_path / "work"), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "megarl threads by voluntary ctx switches" in proc.stdout
    figures = json.loads(out.read_text())
    m, t = figures["megarl"], figures["trl"]
    printed = {line[:40].strip(): line[40:].split() for line in proc.stdout.splitlines()}
    for row, key in (
        ("median s/step (steps >= 2, no eval)", "s_per_step"),
        ("median CPU s/step", "cpu_per_step"),
        ("CPU s, whole process", "cpu_s"),
        ("peak RSS MiB", "peak_rss_mib"),
    ):
        assert printed[row][2] == f"{m[key] / t[key]:.2f}x", (row, printed[row], m[key], t[key])
    for f in (m, t):
        assert sorted(f["curve"]) == ["0", "10", "5"]
        assert all(0.0 <= v <= 1.0 for (v,) in f["curve"].values())
        assert 0 < f["s_per_step"] and 0 < f["cpu_per_step"] < f["cpu_s"] and f["peak_rss_mib"] > 100
        assert sum(n for _, n, _ in f["threads"].values()) > 0  # per-thread context switches seen
    for side in ("megarl", "trl"):  # both sides ran all 10 steps
        (run,) = figures["runs"][side]
        assert sorted(int(k) for k in run["step_time_at"]) == list(range(11))
