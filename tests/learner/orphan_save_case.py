"""A stand-in trainer for test_checkpoint_orphans.py: saves one learner checkpoint (megatron's
writer starts its helper processes), prints ``HELPERS <json>`` with every process descended from
it, then sleeps until the test SIGKILLs it. A ``__main__`` guard keeps a spawned child (megatron's
own results-queue Manager, when megarl's in-process queue is not installed) from running it again.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc/*/stat parent links)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(stat[1]), []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def main(workdir: str) -> None:
    import dist_cases as dc

    from megarl.learner.dist_checkpoint import save_checkpoint
    from megarl.learner.learner import Learner, LearnerConfig, OptimConfig
    from megarl.learner.parallel import ParallelLayout, init_distributed, initialize_parallel

    init_distributed()
    _, hf_dir = dc.make_hf_model(True, workdir)
    ln = Learner(
        LearnerConfig(hf_config=hf_dir, optim=OptimConfig(lr=1e-3)), initialize_parallel(ParallelLayout())
    )
    ln.load_hf(hf_dir)
    ln.train_step(dc.make_batch(1), dc.PolicyGradientObjective(), num_micro_batches=1)  # optimizer state
    save_checkpoint(ln, os.path.join(workdir, "ckpt0"))
    print("HELPERS " + json.dumps(descendants(os.getpid())), flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1])
