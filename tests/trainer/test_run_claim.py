"""One run per run directory: checkpoint.resume / checkpoint.on_existing at start-up (run_claim).

A previous run's outputs are made by hand here (the layout megarl.rundir describes); the
end-to-end case, with a real run, is in tests/trainer/test_quickstart_run.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.rundir import read_run_id
from megarl.trainer.config import ConfigError, load_config
from megarl.trainer.metrics import MetricsWriter
from megarl.trainer.run_claim import check_run_dir, claim_run_dir

ROOT = Path(__file__).parents[2]


def cfg(run_dir: Path, resume: str, on_existing: str = "refuse"):
    return load_config(
        ROOT / "examples" / "quickstart.yaml",
        [
            f"logging.run_dir={run_dir}",
            f"checkpoint.resume={resume}",
            f"checkpoint.on_existing={on_existing}",
        ],
    )


def old_run(run_dir: Path) -> str:
    """A finished run's outputs: run id, metrics, two checkpoints, the initial policy, a plot."""
    run_id = claim_run_dir(cfg(run_dir, "auto"), log=lambda s: None)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "run_id": run_id}) + "\n")
    for step in (2, 4):
        d = run_dir / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / "trainer.json").write_text(json.dumps({"step": step, "run_id": run_id}))
    (run_dir / "init_policy").mkdir()
    (run_dir / "curves.png").write_bytes(b"png")
    (run_dir / "rendezvous").mkdir()  # a launcher's, not the trainer's: never moved or deleted
    return run_id


def test_resume_never_refuses_a_used_run_dir_naming_what_it_holds(tmp_path):
    run_dir = tmp_path / "run"
    run_id = old_run(run_dir)
    with pytest.raises(ConfigError) as e:
        check_run_dir(cfg(run_dir, "never"))
    msg = str(e.value)
    assert f"logging.run_dir {run_dir} already holds a run (run id {run_id}, checkpoints step_000002, " in msg
    assert "checkpoint.on_existing: archive" in msg and "overwrite" in msg
    assert read_run_id(run_dir) == run_id  # untouched


def test_resume_never_into_a_fresh_or_job_only_dir_is_a_new_run(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "rendezvous").mkdir(parents=True)  # what a launcher writes before the trainer starts
    check_run_dir(cfg(run_dir, "never"))
    run_id = claim_run_dir(cfg(run_dir, "never"), log=lambda s: None)
    assert read_run_id(run_dir) == run_id


def test_archive_moves_the_old_run_and_starts_a_new_one(tmp_path):
    run_dir = tmp_path / "run"
    old_id = old_run(run_dir)
    c = cfg(run_dir, "never", "archive")
    check_run_dir(c)
    logs: list[str] = []
    new_id = claim_run_dir(c, logs.append)
    archive = tmp_path / f"run.archived-{old_id}"
    assert logs == [f"megarl train: moved the previous run's outputs from {run_dir} to {archive}"]
    assert new_id != old_id and read_run_id(run_dir) == new_id
    assert sorted(p.name for p in run_dir.iterdir()) == ["rendezvous", "run_id"]
    assert read_run_id(archive) == old_id
    assert sorted(p.name for p in (archive / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    assert (archive / "init_policy").is_dir() and (archive / "metrics.jsonl").is_file()


def test_archive_never_overwrites_an_earlier_archive(tmp_path):
    run_dir = tmp_path / "run"
    old_id = old_run(run_dir)
    (tmp_path / f"run.archived-{old_id}").mkdir()
    claim_run_dir(cfg(run_dir, "never", "archive"), log=lambda s: None)
    assert read_run_id(tmp_path / f"run.archived-{old_id}-2") == old_id
    assert not any((tmp_path / f"run.archived-{old_id}").iterdir())


def test_overwrite_deletes_the_old_run(tmp_path):
    run_dir = tmp_path / "run"
    old_id = old_run(run_dir)
    new_id = claim_run_dir(cfg(run_dir, "never", "overwrite"), log=lambda s: None)
    assert new_id != old_id
    assert sorted(p.name for p in run_dir.iterdir()) == ["rendezvous", "run_id"]
    assert not any(p.name.startswith("run.archived") for p in tmp_path.iterdir())


def test_resume_auto_continues_the_run_it_finds(tmp_path):
    run_dir = tmp_path / "run"
    old_id = old_run(run_dir)
    check_run_dir(cfg(run_dir, "auto"))
    assert claim_run_dir(cfg(run_dir, "auto"), log=lambda s: None) == old_id
    assert (run_dir / "checkpoints" / "step_000004").is_dir()


def test_a_lost_run_id_file_is_taken_back_from_the_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    old_id = old_run(run_dir)
    (run_dir / "run_id").unlink()
    assert claim_run_dir(cfg(run_dir, "auto"), log=lambda s: None) == old_id
    assert read_run_id(run_dir) == old_id


def test_metrics_records_carry_the_run_id_and_truncation_keeps_this_run(tmp_path):
    w = MetricsWriter(tmp_path, run_id="run-b")
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "run_id": "run-a"}) + "\n" + json.dumps({"step": 1}) + "\n"
    )
    w.write({"step": 1, "reward/mean": 0.5})
    w.write({"step": 2, "reward/mean": 0.7})
    w.truncate_after(1)
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert recs == [{"step": 1}, {"step": 1, "reward/mean": 0.5, "run_id": "run-b"}]
