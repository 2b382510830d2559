"""What rank 0 shows per step: an in-place bar on a terminal, one line per step elsewhere.

On a terminal (``logging.progress: auto`` with stdout a TTY, or ``bar``) a tqdm bar redraws in place
with the step, reward, accuracy of the step's samples, staleness (asynchronous loop) and ETA; the full
step line (the ``lines`` format) is printed above it at evaluation steps and at the last step, and
every other message of the run goes above it too (``megarl.trainer.setup.log``). In a log file or CI
(not a TTY, or ``lines``) each ``logging.print_every``-th step prints its full line, as before.
"""

from __future__ import annotations

import shutil
import sys
from typing import Any

from megarl.trainer import setup
from megarl.trainer.evaluation import eval_text
from megarl.trainer.metrics import Progress


def bar_postfix(rec: dict) -> str:
    """The short numbers beside the bar: reward, accuracy, staleness, samples spent and their
    effective fraction (each only when present)."""
    parts = []
    for key, label, fmt in (
        ("reward/mean", "reward", "{:.3f}"),
        ("rollout/accuracy", "acc", "{:.3f}"),
        ("async/staleness_max", "stale", "{:d}"),
        ("budget/samples", "samples", "{:d}"),
        ("budget/effective_frac", "eff", "{:.2f}"),
    ):
        v = rec.get(key)
        if isinstance(v, (int, float)):
            parts.append(f"{label} {fmt.format(int(v) if fmt == '{:d}' else v)}")
    return "  ".join(parts)


class StepDisplay:
    """``show(step, rec, last)`` after each step's record; ``close()`` before the end-of-run summary."""

    def __init__(
        self, total: int, start_step: int, mode: str = "auto", print_every: int = 1, stream: Any = None
    ):
        self.stream = stream if stream is not None else sys.stdout
        self.lines = Progress(total, start_step, "lines")
        self.print_every = max(print_every, 1)
        self._bar = None
        if Progress(total, start_step, mode, stream=self.stream).bar:
            from tqdm import tqdm

            size = shutil.get_terminal_size((100, 20))

            self._bar = tqdm(
                total=total,
                initial=start_step,
                file=self.stream,
                ncols=size.columns,  # a pty may report 0 x 0: the fallback size then
                nrows=size.lines,
                unit="step",
                bar_format="step {n_fmt}/{total_fmt} |{bar}| {percentage:3.0f}%{postfix}  "
                "[{elapsed} < eta {remaining}]",
            )
            setup.set_log_writer(self._write)

    def _write(self, msg: str) -> None:
        """A line above the bar (the bar redraws below it)."""
        self._bar.write(msg, file=self.stream)

    @property
    def in_place(self) -> bool:
        """Whether a bar is drawn in place (a terminal)."""
        return self._bar is not None

    def show(self, step: int, rec: dict, last: bool = False) -> None:
        """Show ``step``'s record: move the bar (terminal) or print the line when due."""
        line = self.lines.line(step, rec) + eval_text(rec)
        if self._bar is None:
            if step % self.print_every == 0 or last:
                setup.log(line)
            return
        self._bar.set_postfix_str(bar_postfix(rec), refresh=False)
        self._bar.update(step - self._bar.n)
        if last or any(k.startswith("eval/") for k in rec):
            self._write(line)

    def close(self) -> None:
        """Finish the bar; later messages print as plain lines."""
        if self._bar is not None:
            self._bar.close()
            setup.set_log_writer(None)
            self._bar = None
