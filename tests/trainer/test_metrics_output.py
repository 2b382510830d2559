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


def test_step_display_draws_in_place_on_a_terminal_and_prints_lines_elsewhere(capsys):
    from megarl.trainer import setup
    from megarl.trainer.live_progress import StepDisplay

    tty = Tty()
    d = StepDisplay(4, 0, "auto", stream=tty)
    assert d.in_place
    for step in (1, 2, 3):
        rec = {"reward/mean": 0.25 * step, "rollout/accuracy": 0.125 * step, "async/staleness_max": 1}
        d.show(step, rec | ({"eval/pass@1": 0.5} if step == 2 else {}))
    setup.log("checkpoint somewhere")  # other messages go above the bar, not into it
    d.show(4, {"reward/mean": 1.0}, last=True)
    d.close()
    out = tty.getvalue()
    assert "\r" in out and "reward 0.750  acc 0.375  stale 1" in out and "step 3/4 |" in out
    lines = [ln.split("\r")[-1] for ln in out.split("\n")]
    full = [ln for ln in lines if ln.startswith("step ") and "/4  reward" in ln]
    assert [ln[:16] for ln in full] == ["step    2/4  rew", "step    4/4  rew"], out  # eval and last steps
    assert "held-out pass@1 0.500" in full[0] and "checkpoint somewhere" in lines
    assert capsys.readouterr().out == ""  # nothing leaked to stdout
    setup.log("after the bar")
    assert capsys.readouterr().out == "after the bar\n"

    plain = io.StringIO()
    d = StepDisplay(4, 0, "auto", print_every=2, stream=plain)
    assert not d.in_place
    for step in (1, 2, 3, 4):
        d.show(step, {"reward/mean": 0.5}, last=step == 4)
    d.close()
    printed = capsys.readouterr().out.splitlines()  # one line per print_every-th step, through log()
    assert [ln[:11] for ln in printed] == ["step    2/4", "step    4/4"] and "reward 0.500" in printed[0]
    assert plain.getvalue() == ""
