"""Checkpoint directory convention shared by the launcher (auto-resume) and learner programs.

Layout: ``CKPT_DIR/step_00000012/`` (complete checkpoints, made under a temporary name and renamed when whole)
and ``CKPT_DIR/latest`` (the name of the newest complete one, replaced atomically). A kill at any moment
leaves either the previous or the new checkpoint as ``latest``, never a half-written one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from megarl.launch.files import atomic_write_text

LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def commit_checkpoint(ckpt_dir: Path, step: int, write: Callable[[Path], None], keep: int = 2) -> Path:
    """Call ``write(tmp_dir)`` to fill a fresh directory, then publish it as the checkpoint of ``step``.

    keep: complete checkpoints to keep (older ones are deleted after ``latest`` moves on).
    """
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / step_dir_name(step)
    tmp = ckpt_dir / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    for f in tmp.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(ckpt_dir / LATEST, final.name + "\n")
    steps = sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def find_latest(ckpt_dir: Path) -> tuple[int, Path] | None:
    """(step, directory) of the newest complete checkpoint, or None when there is none yet."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = Path(ckpt_dir) / name
    if not name.startswith("step_") or not path.is_dir():
        raise FileNotFoundError(
            f"{pointer} names {name!r}, which is not a checkpoint directory in {ckpt_dir}"
        )
    return int(name.removeprefix("step_")), path
