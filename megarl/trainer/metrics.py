"""Metrics: one JSON line per step in ``run_dir/metrics.jsonl``, plain progress lines on stdout,
tensorboard when asked and installed."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path


class MetricsWriter:
    """Appends records to metrics.jsonl; on resume, drops records newer than the checkpoint."""

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = False):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                print("megarl train: logging.tensorboard=true but tensorboard is not installed; "
                      "writing metrics.jsonl only", file=sys.stderr)

    def truncate_after(self, step: int) -> None:
        """Keep only records with ``step <= step`` (work after the checkpoint is redone on resume)."""
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if rec.get("step", 0) <= step:
                keep.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, record.get("step", 0))


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """All records of ``run_dir/metrics.jsonl``."""
    p = Path(run_dir) / "metrics.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


class Progress:
    """One line per step: step/total, ETA and the main numbers."""

    def __init__(self, total: int, start_step: int):
        self.total, self.start_step, self.t0 = total, start_step, time.time()

    def line(self, step: int, m: dict) -> str:
        done = step - self.start_step
        el = time.time() - self.t0
        eta = el / max(done, 1) * (self.total - step)

        def f(key: str, fmt: str = "{:.3f}") -> str:
            v = m.get(key)
            return "-" if v is None else fmt.format(v)

        return (f"step {step:>4}/{self.total}  reward {f('reward/mean')}  loss {f('train/loss', '{:+.4f}')}  "
                f"kl {f('train/kl', '{:.5f}')}  entropy {f('train/entropy')}  "
                f"resp_len {f('rollout/response_len', '{:.1f}')}  "
                f"tok/s roll {f('perf/rollout_tokens_per_s', '{:.0f}')} train {f('perf/train_tokens_per_s', '{:.0f}')}  "
                f"{f('time/step', '{:.1f}')}s  eta {eta:.0f}s")
