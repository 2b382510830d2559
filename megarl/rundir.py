"""What a run directory holds, readable without the trainer (faults, proxies and tools use it).

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


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """All records of ``run_dir/metrics.jsonl`` ([] when there is none)."""
    p = Path(run_dir) / METRICS
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
