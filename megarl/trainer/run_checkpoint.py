"""Run-directory checkpoints: learner state (megarl.learner.dist_checkpoint) + trainer state, atomically.

Layout::

    run_dir/checkpoints/step_000010/learner/       megatron dist_checkpointing (model, optimizer, ...)
    run_dir/checkpoints/step_000010/trainer.json   step, sampler position, policy version, counters, RNG

Everything is written into ``step_000010.tmp`` and renamed at the end, so a kill mid-save leaves
either the previous checkpoints or the complete new one; ``latest_checkpoint`` ignores ``.tmp`` dirs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

TRAINER_STATE = "trainer.json"


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def _step_dirs(run_dir) -> list[tuple[int, Path]]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.name.startswith("step_") and p.name[5:].isdigit() and (p / TRAINER_STATE).is_file():
            out.append((int(p.name[5:]), p))
    return sorted(out)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    dirs = _step_dirs(run_dir)
    return dirs[-1][1] if dirs else None


def _rng_state() -> dict:
    return {
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
        "torch": torch.get_rng_state().tolist(),
    }


def _set_rng_state(st: dict) -> None:
    random.setstate((st["python_version"], tuple(st["python"]), st["python_gauss"]))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))


OBJECTIVE_STATE = "objective.pt"
METHOD_STATE = "method.pt"  # estimator state, round processors, step hooks (MethodRuntime.state_dict)


def save(
    run_dir: str | os.PathLike,
    step: int,
    learner,
    trainer_state: dict,
    keep_last: int,
    objective_state: dict | None = None,
    method_state: dict | None = None,
) -> Path:
    """Write checkpoint ``step`` (collective over the world) and prune to the newest ``keep_last``.

    ``objective_state``: the stateful objective parts (e.g. a policy loss's running statistics), saved
    with torch.save next to the trainer state (identical on every rank: rank 0 writes it).
    ``method_state``: the rest of the method state (estimator state, round processors, step
    hooks), rank 0's view."""
    from megarl.learner.dist_checkpoint import save_checkpoint

    root = checkpoint_root(run_dir)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    rank0 = dist.get_rank() == 0
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        if final.exists():  # re-saving the same step after a resume: replace it
            shutil.rmtree(final)
        tmp.mkdir()
    dist.barrier()
    save_checkpoint(learner, tmp / "learner")
    if rank0:
        state = dict(trainer_state, step=step, rng=_rng_state())
        with open(tmp / TRAINER_STATE, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        if objective_state:
            torch.save(objective_state, tmp / OBJECTIVE_STATE)
        if method_state:
            torch.save(method_state, tmp / METHOD_STATE)
        os.rename(tmp, final)
        for _, old in _step_dirs(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load(ckpt: Path, learner) -> dict:
    """Load the learner (collective) and return the trainer state (RNG restored)."""
    from megarl.learner.dist_checkpoint import load_checkpoint

    load_checkpoint(learner, ckpt / "learner")
    with open(ckpt / TRAINER_STATE) as f:
        state = json.load(f)
    _set_rng_state(state["rng"])
    return state


def load_objective_state(ckpt: Path) -> dict:
    """The objective state saved with checkpoint ``ckpt`` ({} when it had none)."""
    path = ckpt / OBJECTIVE_STATE
    return torch.load(path, weights_only=True) if path.exists() else {}


def load_method_state(ckpt: Path) -> dict:
    """The method state saved with checkpoint ``ckpt`` ({} when it had none)."""
    path = ckpt / METHOD_STATE
    return torch.load(path, weights_only=True) if path.exists() else {}
