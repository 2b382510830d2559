"""One run per run directory: ``checkpoint.resume`` and ``checkpoint.on_existing`` at start-up.

``resume: auto`` continues the run the directory holds (its ``run_id``; a new id for a fresh
directory). ``resume: never`` starts a new run, so a directory that already holds one (a run id,
metrics, checkpoints or a warmed-up initial policy) is refused unless ``on_existing`` says
``archive`` (its run outputs move to the sibling ``<run_dir>.archived-<old run id>``) or
``overwrite`` (they are deleted). Only what the trainer writes moves; other entries (a launcher's
``rendezvous/``, a job's logs) stay. Without this a new run silently continued the old one: it
reused the old initial policy, pruned its own first checkpoint against the old run's step numbers
and left ``resume: auto`` to pick the old run's checkpoint later.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

from megarl.rundir import CHECKPOINTS, INIT_POLICY, METRICS, RUN_CONTENTS, RUN_ID, read_run_id
from megarl.trainer.config import ConfigError, TrainConfig

# Everything the trainer writes directly under run_dir (what archive moves and overwrite deletes).
TRAINER_OUTPUTS = (
    *RUN_CONTENTS,
    "config.resolved.yaml",
    "curves.png",
    "tensorboard",
    "wandb_run_id",
    "dumps",
    "weights",
    "vllm-server",
)


def existing_run(run_dir: Path) -> str | None:
    """A description of the run ``run_dir`` holds (None when it holds none)."""
    found = [name for name in RUN_CONTENTS if (run_dir / name).exists()]
    if not found:
        return None
    steps = sorted(p.name for p in (run_dir / CHECKPOINTS).glob("step_*")) if CHECKPOINTS in found else []
    parts = [f"run id {read_run_id(run_dir) or 'unknown'}"]
    parts += [f"checkpoints {', '.join(steps)}"] if steps else []
    parts += [name for name in (METRICS, INIT_POLICY) if name in found]
    return ", ".join(parts)


def check_run_dir(cfg: TrainConfig) -> None:
    """Refuse ``resume: never`` into a directory that holds a run unless ``on_existing`` allows it
    (every rank, before anything is written)."""
    ck, run_dir = cfg.checkpoint, Path(cfg.logging.run_dir)
    if ck.resume != "never" or ck.on_existing != "refuse":
        return
    held = existing_run(run_dir)
    if held:
        raise ConfigError(
            f"logging.run_dir {run_dir} already holds a run ({held}); checkpoint.resume: never starts "
            "a new run, and a run directory holds one run. Choose another logging.run_dir, continue "
            "that run with checkpoint.resume: auto, or set checkpoint.on_existing: archive (moves its "
            f"outputs to {run_dir}.archived-<run id>) or overwrite (deletes them)"
        )


def _archive_dir(run_dir: Path) -> Path:
    base = f"{run_dir.name}.archived-{read_run_id(run_dir) or time.strftime('%Y%m%d-%H%M%S')}"
    out, n = run_dir.parent / base, 1
    while out.exists():
        n += 1
        out = run_dir.parent / f"{base}-{n}"
    return out


def _checkpoints_run_id(run_dir: Path) -> str | None:
    """The run id the newest checkpoint under ``run_dir`` records (a run_dir whose run_id file was
    lost keeps its run); None when there is none."""
    for ckpt in sorted((run_dir / CHECKPOINTS).glob("step_*/trainer.json"), reverse=True):
        try:
            return json.loads(ckpt.read_text()).get("run_id")
        except (OSError, ValueError):
            continue
    return None


def claim_run_dir(cfg: TrainConfig, log=print) -> str:
    """Rank 0: make ``logging.run_dir`` this run's (archiving or deleting a previous run's outputs
    when ``resume: never`` and ``on_existing`` ask for it); returns the run id, written to
    ``run_dir/run_id`` for a new run."""
    ck, run_dir = cfg.checkpoint, Path(cfg.logging.run_dir)
    if ck.resume == "never" and existing_run(run_dir):
        check_run_dir(cfg)
        outputs = [run_dir / name for name in TRAINER_OUTPUTS if (run_dir / name).exists()]
        if ck.on_existing == "archive":
            dest = _archive_dir(run_dir)
            dest.mkdir()
            for p in outputs:
                p.rename(dest / p.name)
            log(f"megarl train: moved the previous run's outputs from {run_dir} to {dest}")
        else:
            for p in outputs:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            log(f"megarl train: deleted the previous run's outputs in {run_dir} (on_existing: overwrite)")
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = read_run_id(run_dir)
    if run_id is None:  # a new run, or one whose run_id file was lost (its checkpoints know it)
        run_id = _checkpoints_run_id(run_dir) or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        tmp = run_dir / f"{RUN_ID}.tmp"
        tmp.write_text(run_id + "\n")
        tmp.rename(run_dir / RUN_ID)
    return run_id
