"""Checkpoint failure cases on a real (tiny) learner, one process on CPU; prints one JSON line.

``python tests/trainer/checkpoint_case.py MODE RUN_DIR``:

- ``enospc``: saves step 1, then step 2 with every write of megatron's shard writer failing with
  ENOSPC after its first KiB (the file object's ``write``, patched where the writer opens files);
- ``fill``: saves steps 1, 2, ... (keep_last 1) until the disk under RUN_DIR is full (the caller
  puts RUN_DIR on a small tmpfs);
- ``truncate``: saves steps 1 and 2, cuts step 2's largest shard file in half, then asks which
  checkpoint a resume takes and loads it into a fresh learner; also loads step 2 directly.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import traceback
from pathlib import Path

from tests.learner.release_case import HF, batch, objective

SMALL = dict(HF, hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=512)


def learner():
    from megarl.learner.factory import build_learner
    from megarl.learner.optim_config import OptimConfig
    from megarl.learner.parallel import ParallelLayout, initialize_parallel
    from megarl.objectives.api import GlobalNormalisers

    ln = build_learner(SMALL, initialize_parallel(ParallelLayout()), OptimConfig(lr=1e-3))
    b = batch()
    ln.train_step(b, objective, 1, GlobalNormalisers.from_batch(b, None, 8.0))
    return ln


def save(run_dir: Path, step: int, ln, keep_last: int = 3):
    from megarl.trainer import run_checkpoint

    return run_checkpoint.save(
        run_dir, step, ln, {"sampler": {}, "run_id": "run-a"}, keep_last, objective_state={"x": step}
    )


def listing(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def failed_save(run_dir: Path, step: int, ln) -> dict:
    try:
        save(run_dir, step, ln, keep_last=1)
    except Exception as e:
        return {"error_type": type(e).__name__, "message": str(e), "step": step}
    return {}


def ran_out_of_space(run_dir: Path) -> bool:
    """An ENOSPC written into the file object's ``write`` where megatron's writer opens files."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    class FullDisk:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, data):
            self.n += len(data)
            if self.n > 1024:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.f.name)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    filesystem_async.open = lambda *a, **k: FullDisk(open(*a, **k))
    return True


def damaged_copy(learner_dir: Path, dest: Path) -> list[str]:
    """What the completeness check says of a copy of ``learner_dir`` with one shard file gone and
    ``common.pt`` cut short."""
    import shutil

    from megarl.learner.checkpoint_files import checkpoint_problems

    shutil.copytree(learner_dir, dest)
    sorted(dest.glob("*.distcp"))[0].unlink()
    common = dest / "common.pt"
    common.write_bytes(common.read_bytes()[:100])
    return checkpoint_problems(dest)


def main(mode: str, run_dir: Path) -> dict:
    from megarl.trainer import run_checkpoint
    from megarl.trainer.checkpoint_check import ForeignCheckpointError, resume_checkpoint

    ln = learner()
    out: dict = {}
    if mode == "enospc":
        save(run_dir, 1, ln)
        ran_out_of_space(run_dir)
        out = failed_save(run_dir, 2, ln)
    elif mode == "fill":
        for step in range(1, 200):
            out = failed_save(run_dir, step, ln)
            if out:
                break
    elif mode == "truncate":
        save(run_dir, 1, ln)
        save(run_dir, 2, ln)
        shards = sorted((run_dir / "checkpoints/step_000002/learner").glob("*.distcp"), key=os.path.getsize)
        cut = shards[-1]
        with open(cut, "r+b") as f:
            f.truncate(os.path.getsize(cut) // 2)
        logs: list[str] = []
        pick = resume_checkpoint(run_dir, "run-a", logs.append)
        state = run_checkpoint.load(pick, learner())
        try:
            run_checkpoint.load(run_dir / "checkpoints/step_000002", learner())
            direct = "loaded"
        except Exception as e:
            direct = f"{type(e).__name__}: {e}"
        try:
            resume_checkpoint(run_dir, "run-b", logs.append)
            foreign = "accepted"
        except ForeignCheckpointError as e:
            foreign = str(e)
        out = {
            "damaged": damaged_copy(run_dir / "checkpoints" / "step_000001" / "learner", run_dir / "damaged"),
            "cut": str(cut),
            "pick": str(pick),
            "loaded_step": state["step"],
            "logs": logs,
            "direct_load": direct,
            "foreign": foreign,
        }
    latest = run_checkpoint.latest_checkpoint(run_dir)
    out.update(dirs=listing(run_dir), latest=latest.name if latest else None)
    return out


if __name__ == "__main__":  # megatron's writer spawns a helper that imports this file again
    try:
        print(json.dumps(main(sys.argv[1], Path(sys.argv[2]))))
    except Exception:
        traceback.print_exc()
        sys.exit(1)
