"""Which checkpoint a resumed run loads: the newest one that is complete on disk and of this run.

A checkpoint directory (megarl.trainer.run_checkpoint) is checked without loading a tensor:
``trainer.json`` parses, ``objective.pt`` / ``method.pt`` are whole torch archives, and the learner
checkpoint's shard files are all there at the lengths its index records
(megarl.learner.checkpoint_files). A broken newest checkpoint (a shard cut short by a full disk or
a node lost mid-copy) is skipped with a log line naming its files, and the next newer complete one
is used; nothing is deleted. A checkpoint written by another run (its ``run_id`` differs from the
run directory's) is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from megarl.learner.checkpoint_files import checkpoint_problems as learner_problems
from megarl.learner.checkpoint_files import torch_archive_problem
from megarl.trainer.run_checkpoint import METHOD_STATE, OBJECTIVE_STATE, TRAINER_STATE, _step_dirs


class ForeignCheckpointError(RuntimeError):
    """A checkpoint in the run directory was written by another run (its run id differs)."""


def checkpoint_problems(ckpt: Path) -> list[str]:
    """What is missing or cut short in checkpoint directory ``ckpt`` ([] when complete)."""
    problems = []
    try:
        json.loads((ckpt / TRAINER_STATE).read_text())
    except (OSError, ValueError) as e:
        problems.append(f"{ckpt / TRAINER_STATE}: unreadable ({e})")
    for name in (OBJECTIVE_STATE, METHOD_STATE):
        if (ckpt / name).exists():
            problem = torch_archive_problem(ckpt / name)
            problems += [problem] if problem else []
    return problems + learner_problems(ckpt / "learner")


def checkpoint_run_id(ckpt: Path) -> str | None:
    """The run id recorded in ``ckpt``'s trainer state (None for a checkpoint without one)."""
    return json.loads((ckpt / TRAINER_STATE).read_text()).get("run_id")


def resume_checkpoint(run_dir: str | Path, run_id: str | None, log: Callable[[str], None]) -> Path | None:
    """The newest complete checkpoint of run ``run_id`` under ``run_dir`` (None when there is none).

    Broken checkpoints are skipped (and logged); a complete one of another run raises
    ``ForeignCheckpointError``."""
    for _, ckpt in reversed(_step_dirs(run_dir)):
        problems = checkpoint_problems(ckpt)
        if problems:
            shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
            log(f"megarl train: skipping incomplete checkpoint {ckpt} ({shown}); it is left on disk")
            continue
        saved = checkpoint_run_id(ckpt)
        if run_id is not None and saved is not None and saved != run_id:
            raise ForeignCheckpointError(
                f"{ckpt} was written by run {saved}, but {run_dir} holds run {run_id}: refusing to "
                "resume another run's checkpoint (move it out of the run directory, or start a new "
                "run with checkpoint.resume: never)"
            )
        return ckpt
    return None
