"""Metrics outputs: tensorboard event files (read back with tensorboard's own reader), the resume
purge, wandb absent = a notice and no failure, the progress bar on a terminal and plain lines in logs."""

import io
import json

import pytest

from megarl.trainer.metrics import MetricsWriter, Progress


def scalars(logdir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir))
    ea.Reload()
    return [(e.step, round(e.value, 6)) for e in ea.Scalars(tag)]


def test_tensorboard_events_and_resume_purge(tmp_path):
    pytest.importorskip("tensorboard")
    w = MetricsWriter(tmp_path, tensorboard=True)
    for s in (1, 2, 3):
        w.write(
            {
                "step": s,
                "reward/mean": 0.1 * s,
                "rollout/example": "12",
                "async/versions": {"0": 4},
                "train/loss": float("nan"),
            }
        )
    w.close()
    assert scalars(tmp_path / "tensorboard", "reward/mean") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    # resumed from the step-1 checkpoint: steps 2 and 3 are redone, the old ones hidden
    w = MetricsWriter(tmp_path, tensorboard=True)
    w.truncate_after(1)
    for s in (2, 3):
        w.write({"step": s, "reward/mean": 0.5 * s})
    w.close()
    assert scalars(tmp_path / "tensorboard", "reward/mean") == [(1, 0.1), (2, 1.0), (3, 1.5)]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and lines[1]["reward/mean"] == 1.0
    assert lines[0]["train/loss"] is None  # non-finite -> null in the jsonl


def test_wandb_missing_is_a_notice_not_an_error(tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    w = MetricsWriter(tmp_path, wandb=True)
    w.write({"step": 1, "reward/mean": 0.5})
    w.close()
    assert "wandb is not installed" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal_plain_lines_in_logs():
    rec = {"reward/mean": 0.5, "train/loss": -0.01, "time/step": 1.0}
    bar = Progress(40, 0, "auto", stream=Tty())
    plain = Progress(40, 0, "auto", stream=io.StringIO())
    assert bar.bar and not plain.bar
    b, p = bar.line(10, rec), plain.line(10, rec)
    assert b.startswith("|██████ ") and " 25% " in b and "eta 0:00" in b and "step   10/40  reward 0.500" in b
    assert p.startswith("step   10/40  reward 0.500") and "█" not in p and p.endswith("s")
    assert Progress(40, 0, "bar", stream=io.StringIO()).bar
    assert not Progress(40, 0, "lines", stream=Tty()).bar
    full = Progress(8, 0, "bar", width=8).line(8, rec)
    assert full.startswith("|████████| 100% ")
    with pytest.raises(ValueError, match="allowed: 'auto', 'bar', 'lines'"):
        Progress(1, 0, "fancy")
