"""What a run directory holds, readable without the trainer (faults, proxies and tools use it).

run_dir/run_id                 the id of the one run this directory holds (also in each checkpoint)
run_dir/config.resolved.yaml   the fully resolved config
run_dir/init_policy/           HF weights after the warm-up (the RL start and the KL reference)
run_dir/metrics.jsonl          one JSON record per step
run_dir/checkpoints/step_N/    resumable checkpoints
"""

from __future__ import annotations

import json
import os
from pathlib import Path

INIT_POLICY = "init_policy"
METRICS = "metrics.jsonl"
RUN_ID = "run_id"
CHECKPOINTS = "checkpoints"
# What marks a directory as holding a run (a run_dir may also hold a job's own logs).
RUN_CONTENTS = (RUN_ID, METRICS, CHECKPOINTS, INIT_POLICY)


def read_run_id(run_dir: str | os.PathLike) -> str | None:
    """The run id of ``run_dir`` (None when it has none: a fresh directory or an older megarl's)."""
    p = Path(run_dir) / RUN_ID
    if not p.is_file():
        return None
    return p.read_text().strip() or None


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """All records of ``run_dir/metrics.jsonl`` ([] when there is none)."""
    p = Path(run_dir) / METRICS
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
