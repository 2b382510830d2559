"""Run-directory checkpoints: learner state (megarl.learner.dist_checkpoint) + trainer state, atomically.

Layout::

    run_dir/checkpoints/step_000010/learner/       megatron dist_checkpointing (model, optimizer, ...)
    run_dir/checkpoints/step_000010/trainer.json   step, sampler position, policy version, counters, RNG

Everything is written into ``step_000010.tmp`` and renamed at the end, so a kill mid-save leaves
either the previous checkpoints or the complete new one; ``latest_checkpoint`` ignores ``.tmp`` dirs.
A save that fails (a full disk: ``CheckpointSaveError``) removes its ``.tmp`` dir and leaves the
earlier checkpoints as they were. ``resume_checkpoint`` picks the newest checkpoint that is complete
on disk (megarl.trainer.checkpoint_check), skipping and naming the broken ones, deleting nothing.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

TRAINER_STATE = "trainer.json"


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the message names the path, the step and the last
    complete checkpoint."""


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
    sharded_parts: list | None = None,
) -> Path:
    """Write checkpoint ``step`` (collective over the world) and prune to the newest ``keep_last``.

    ``objective_state``: the stateful objective parts (e.g. a policy loss's running statistics), saved
    with torch.save next to the trainer state (identical on every rank: rank 0 writes it).
    ``method_state``: the rest of the method state (estimator state, round processors, step
    hooks), rank 0's view. ``sharded_parts``: (folder, part) pairs whose ``save_sharded`` writes a
    model of their own into that folder of the checkpoint, collectively."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megarl.learner.dist_checkpoint import save_checkpoint

    root = checkpoint_root(run_dir)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    rank0 = dist.get_rank() == 0
    previous = latest_checkpoint(run_dir)
    try:
        if rank0:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        dist.barrier()
        save_checkpoint(learner, tmp / "learner")
        for name, part in sharded_parts or []:
            part.save_sharded(tmp / name)
        failure = None
        if rank0:
            try:
                _write_trainer_files(tmp, dict(trainer_state, step=step), objective_state, method_state)
                if final.exists():  # re-saving the same step after a resume: replace it
                    shutil.rmtree(final)
                os.rename(tmp, final)
            except (OSError, RuntimeError) as e:
                failure = e
        failed = [failure is not None]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(failed, src=0)  # every rank raises together
        if failure is not None:
            raise failure
        if failed[0]:
            raise CheckpointSaveError(f"saving checkpoint step {step} under {root} failed on rank 0")
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        error = _save_error(e, root, step, previous)  # before the cleanup frees the partial files
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is e:
            raise
        raise error from e
    if rank0:
        for _, old in _step_dirs(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _write_trainer_files(tmp: Path, state: dict, objective_state: dict | None, method_state: dict | None):
    with open(tmp / TRAINER_STATE, "w") as f:
        json.dump(dict(state, rng=_rng_state()), f)
        f.flush()
        os.fsync(f.fileno())
    if objective_state:
        torch.save(objective_state, tmp / OBJECTIVE_STATE)
    if method_state:
        torch.save(method_state, tmp / METHOD_STATE)


# What an ENOSPC / EDQUOT says once megatron's writer workers have turned it into text.
_DISK_FULL_TEXTS = ("no space left on device", "[errno 28]", "disk quota exceeded", "[errno 122]")
# What torch's zip writer (torch.save) says when any write fails; the errno does not survive it.
_WRITE_FAILED_TEXTS = ("unexpected pos", "file write failed")


def _chain(e: BaseException):
    """``e``, its causes and contexts, and the per-rank failures a torch CheckpointException wraps."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [x.__cause__, x.__context__]
        for failure in (getattr(x, "failures", None) or {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


def _disk_full_cause(e: BaseException, root: Path) -> BaseException | None:
    """The error in ``e``'s chain that says the disk under ``root`` is full (None when none does):
    an OSError with ENOSPC / EDQUOT, else the innermost error whose text says so."""
    chain = list(_chain(e))
    for x in chain:
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return x
    for x in reversed(chain):
        if any(t in str(x).lower() for t in _DISK_FULL_TEXTS):
            return x
    for x in reversed(chain):
        if any(t in str(x).lower() for t in _WRITE_FAILED_TEXTS):
            try:  # a failed write with (almost) nothing left free: the disk filled up
                return x if shutil.disk_usage(root).free < 64 * 2**20 else None
            except OSError:
                return None
    return None


def _save_error(e: BaseException, root: Path, step: int, previous: Path | None) -> BaseException:
    """The error a failed save raises: ``CheckpointSaveError`` for a full disk, else ``e``."""
    cause = None if isinstance(e, CheckpointSaveError) else _disk_full_cause(e, root)
    if cause is None:
        return e
    last = f"step {int(previous.name[5:])} ({previous})" if previous else "none (no checkpoint yet)"
    try:
        free = f" ({shutil.disk_usage(root).free / 2**20:.1f} MiB free)"
    except OSError:
        free = ""
    said = str(cause).strip().splitlines()
    return CheckpointSaveError(
        f"no space left on {root}{free} while saving checkpoint step {step}; the last complete "
        f"checkpoint is {last}. The partial step_{step:06d}.tmp was removed; free space or point "
        "logging.run_dir elsewhere, then resume (checkpoint.resume: auto). "
        f"The write error: {type(cause).__name__}: {said[0] if said else ''}"
    )


def load(ckpt: Path, learner) -> dict:
    """Load the learner (collective) and return the trainer state (RNG restored)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megarl.learner.dist_checkpoint import CheckpointError, load_checkpoint

    try:
        load_checkpoint(learner, ckpt / "learner")
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # torch's CheckpointException (EOFError) names no path
        inner = [x for x in _chain(e) if not isinstance(x, CheckpointException)] or [e]
        said = str(inner[-1]).strip().splitlines()
        raise CheckpointError(
            f"{ckpt}: loading the learner state failed ({type(inner[-1]).__name__}"
            f"{': ' + said[0] if said else ''}); the checkpoint is incomplete or damaged"
        ) from e
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
