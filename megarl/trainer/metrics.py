"""Metrics: one JSON line per step in ``run_dir/metrics.jsonl``; tensorboard event files and
Weights & Biases when asked (wandb only when installed: never a hard dependency); the progress
display (a bar with ETA on a terminal, plain lines in logs)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from megarl.rundir import read_metrics  # noqa: F401  (re-exported: the trainer's metrics API)


def _scalars(record: dict) -> dict[str, float]:
    """The finite numeric entries of a record (what tensorboard / wandb take), ``step`` excluded."""
    out = {}
    for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
    return out


class MetricsWriter:
    """Appends records to metrics.jsonl (and tensorboard / wandb); on resume, drops records newer
    than the checkpoint (``truncate_after``), in tensorboard too (``purge_step``)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "megarl",
        config: dict | None = None,
        run_id: str | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_id = run_id  # written into every record: the records of one run carry its id
        self.path = self.run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb_wanted = tensorboard
        self._tb = None
        self._wandb = None
        if tensorboard:
            self._open_tensorboard(purge_step=None)
        if wandb:
            self._open_wandb(wandb_project, config)

    @classmethod
    def from_config(cls, run_dir: str | os.PathLike, cfg: Any, run_id: str | None = None) -> MetricsWriter:
        """The writer a ``TrainConfig``'s ``logging`` section asks for, for run ``run_id``."""
        from megarl.trainer.config import to_dict

        lg = cfg.logging
        return cls(
            run_dir,
            tensorboard=lg.tensorboard,
            wandb=lg.wandb,
            wandb_project=lg.wandb_project,
            config=to_dict(cfg) if lg.wandb else None,
            run_id=run_id,
        )

    def _open_tensorboard(self, purge_step: int | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print(
                "megarl train: logging.tensorboard=true but the tensorboard package is not installed; "
                "writing metrics.jsonl only",
                file=sys.stderr,
            )
            return
        if self._tb is not None:
            self._tb.close()
        self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step)

    def _open_wandb(self, project: str, config: dict | None) -> None:
        try:
            import wandb
        except ImportError:
            print(
                "megarl train: logging.wandb=true but wandb is not installed (pip install wandb); "
                "writing metrics.jsonl only",
                file=sys.stderr,
            )
            return
        # one wandb run per run directory: a resumed job continues the same wandb run
        id_file = self.run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
        id_file.write_text(run_id)
        self._wandb = wandb.init(
            project=project,
            id=run_id,
            resume="allow",
            name=self.run_dir.name,
            dir=str(self.run_dir),
            config=config,
        )

    def truncate_after(self, step: int) -> None:
        """Keep only this run's records with ``step <= step`` (work after the checkpoint is redone on
        resume)."""
        if self._tb is not None:
            self._open_tensorboard(purge_step=step + 1)
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            of_this_run = self.run_id is None or rec.get("run_id", self.run_id) == self.run_id
            if rec.get("step", 0) <= step and of_this_run:
                keep.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        """Append one record (non-finite floats become null in the jsonl)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        if self.run_id is not None:
            clean.setdefault("run_id", self.run_id)
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
        step = int(record.get("step", 0))
        if self._tb is not None:
            for k, v in _scalars(record).items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()  # a killed run keeps what it logged
        if self._wandb is not None:
            self._wandb.log(_scalars(record), step=step)

    def close(self) -> None:
        """Flush and close tensorboard / wandb."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _duration(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """The per-step display: step/total, ETA and the main numbers.

    ``mode``: ``bar`` prefixes each line with a progress bar and percentage, ``lines`` writes plain
    lines (what log files want), ``auto`` picks ``bar`` when ``stream`` (default stdout) is a terminal.
    """

    def __init__(self, total: int, start_step: int, mode: str = "auto", stream: Any = None, width: int = 24):
        self.total, self.start_step, self.t0 = total, start_step, time.time()
        if mode not in ("auto", "bar", "lines"):
            raise ValueError(f"progress mode {mode!r}; allowed: 'auto', 'bar', 'lines'")
        stream = stream if stream is not None else sys.stdout
        self.bar = mode == "bar" or (mode == "auto" and hasattr(stream, "isatty") and stream.isatty())
        self.width = width

    def eta(self, step: int) -> float:
        """Seconds left, from the mean time of the steps done in this process."""
        done = step - self.start_step
        return (time.time() - self.t0) / max(done, 1) * (self.total - step)

    def _bar(self, step: int) -> str:
        frac = min(max(step / max(self.total, 1), 0.0), 1.0)
        eighths = round(frac * self.width * 8)
        full, part = divmod(eighths, 8)
        cells = "█" * full + ("" if part == 0 else " ▏▎▍▌▋▊▉"[part])
        return f"|{cells.ljust(self.width)}| {frac * 100:3.0f}% "

    def line(self, step: int, m: dict) -> str:
        """The display line of ``step`` with the metrics record ``m``."""

        def f(key: str, fmt: str = "{:.3f}") -> str:
            v = m.get(key)
            return "-" if v is None else fmt.format(v)

        eta = self.eta(step)
        text = (
            f"step {step:>4}/{self.total}  reward {f('reward/mean')}  loss {f('train/loss', '{:+.4f}')}  "
            f"kl {f('train/kl', '{:.5f}')}  entropy {f('train/entropy')}  "
            f"resp_len {f('rollout/response_len', '{:.1f}')}  "
            f"tok/s roll {f('perf/rollout_tokens_per_s', '{:.0f}')} train "
            f"{f('perf/train_tokens_per_s', '{:.0f}')}  {f('time/step', '{:.1f}')}s"
        )
        if self.bar:
            return f"{self._bar(step)}{text}  eta {_duration(eta)}"
        return f"{text}  eta {eta:.0f}s"
