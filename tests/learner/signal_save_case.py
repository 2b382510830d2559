"""Checkpoint saves while the whole process group is pelted with SIGUSR1 (Slurm signals every
process of a job step). Run by test_checkpoint_signals.py in a session of its own; prints one line
``RESULT {json}``. A ``__main__`` guard keeps a spawned child (megatron's own results-queue Manager)
from running it again.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)


def main(workdir: str, saves: int = 3) -> None:
    import dist_cases as dc

    from megarl.learner.dist_checkpoint import load_checkpoint, save_checkpoint
    from megarl.learner.learner import Learner, LearnerConfig, OptimConfig
    from megarl.learner.parallel import ParallelLayout, init_distributed, initialize_parallel

    init_distributed()
    _, hf_dir = dc.make_hf_model(True, workdir)
    ln = Learner(
        LearnerConfig(hf_config=hf_dir, optim=OptimConfig(lr=1e-3)), initialize_parallel(ParallelLayout())
    )
    ln.load_hf(hf_dir)
    ln.train_step(dc.make_batch(1), dc.PolicyGradientObjective(), num_micro_batches=1)
    received: list[int] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    done = threading.Event()

    def pelt() -> None:
        while not done.is_set():
            os.killpg(os.getpgrp(), signal.SIGUSR1)
            time.sleep(0.002)

    results = []
    for i in range(saves):
        done.clear()
        thread = threading.Thread(target=pelt)
        thread.start()
        path = os.path.join(workdir, f"ckpt{i}")
        try:
            save_checkpoint(ln, path)
            load_checkpoint(ln, path)
            results.append("ok")
        except Exception as e:  # the test reports which save broke and how
            results.append(f"{type(e).__name__}: {e}")
        done.set()
        thread.join()
    print("RESULT " + json.dumps({"saves": results, "signals_received": len(received)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
