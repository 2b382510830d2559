"""curves.png: one labelled panel per logged quantity, only those the run logged; the built-in
rasteriser when matplotlib is missing."""

from __future__ import annotations

import builtins
import json
import struct
from pathlib import Path

from megarl.trainer.plot import panels_for, plot_run


def _write(run_dir: Path, recs: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def _png_size(p: Path) -> tuple[int, int]:
    data = p.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def _records(steps: int = 6) -> list[dict]:
    recs = [{"step": 0, "eval/pass@1": 0.5, "eval/pass@8": 0.75, "eval/sampled_acc": 0.25}]
    for s in range(1, steps + 1):
        recs.append(
            {
                "step": s,
                "reward/mean": 0.1 * s,
                "rollout/accuracy": 0.1 * s,
                "train/loss": 0.01 / s,
                "train/kl": 0.001 * s,
                "train/entropy": 2.0 - 0.1 * s,
                "rollout/example": "text",  # not a number: never plotted
                "train/clip_frac": float("nan") if s == 1 else 0.05,  # a non-finite point is skipped
            }
        )
    return recs


def test_panels_only_for_logged_metrics():
    panels = {title: (ylabel, dict(series)) for title, ylabel, series in panels_for(_records())}
    assert list(panels) == ["reward", "accuracy", "loss", "KL", "entropy", "clip fraction"]  # no lengths
    acc = panels["accuracy"][1]
    assert list(acc) == ["training samples", "held-out samples", "held-out greedy pass@1", "held-out pass@8"]
    assert acc["held-out pass@8"] == [(0, 0.75)]
    assert [s for s, _ in panels["clip fraction"][1]["PPO ratio clip"]] == [2, 3, 4, 5, 6]
    assert panels["entropy"][0] == "entropy (nats/token)"
    assert panels_for([{"step": 1, "time/step": 0.5}]) == []


def test_curves_png_has_a_panel_grid_and_a_title(tmp_path):
    _write(tmp_path / "run", _records())
    (tmp_path / "run" / "config.resolved.yaml").write_text(
        "advantage: {estimator: grpo}\nobjective: {policy_loss: ppo}\n"
    )
    png = plot_run(tmp_path / "run")
    assert png == tmp_path / "run" / "curves.png"
    assert _png_size(png) == (1200, 1020)  # 2 columns x 3 rows of panels at 100 dpi
    from megarl.trainer.metrics import read_metrics
    from megarl.trainer.plot import _title

    assert _title(tmp_path / "run", read_metrics(tmp_path / "run")) == "megarl run run: grpo / ppo, steps 0-6"
    _write(tmp_path / "one", [{"step": s, "reward/mean": 0.5} for s in range(1, 4)])
    assert _png_size(plot_run(tmp_path / "one")) == (600, 380)  # a single panel
    _write(tmp_path / "none", [{"step": 1, "time/step": 0.5}])
    assert plot_run(tmp_path / "none") is None and not (tmp_path / "none" / "curves.png").exists()


def test_without_matplotlib_the_raster_fallback_draws_the_reward(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    _write(tmp_path, _records())
    assert _png_size(plot_run(tmp_path)) == (640, 360)
