"""End-of-run curves as a PNG (``run_dir/curves.png``): one panel per quantity, each drawn only when
the run logged it: reward, accuracy (training samples, held-out samples, greedy pass@1, pass@k), loss,
KL, entropy, clip fraction and response length, against the step, under a title naming the run.

Uses matplotlib (a dependency); where it is missing, a small built-in rasteriser draws the reward
mean and the held-out accuracies (lines on a white canvas, no text) with zlib, so every run still
leaves a picture of its reward curve.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import struct
import zlib
from pathlib import Path

from megarl.trainer.metrics import read_metrics

# the raster fallback's series: reward mean (blue), held-out sampled accuracy (green), greedy pass@1 (red)
_SERIES = (
    ("reward/mean", (31, 119, 180)),
    ("eval/sampled_acc", (44, 160, 44)),
    ("eval/pass@1", (214, 39, 40)),
)

# (panel title, y-axis label, ((metric, legend label), ...)); eval/pass@k with k > 1 joins "accuracy"
PANELS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    (
        "reward",
        "reward",
        (("reward/mean", "training samples (mean)"), ("eval/reward_greedy", "held-out greedy")),
    ),
    (
        "accuracy",
        "fraction correct",
        (
            ("rollout/accuracy", "training samples"),
            ("eval/sampled_acc", "held-out samples"),
            ("eval/pass@1", "held-out greedy pass@1"),
        ),
    ),
    ("loss", "loss", (("train/loss", "total"), ("train/pg_loss", "policy gradient"))),
    ("KL", "KL (nats/token)", (("train/kl", "policy vs reference"),)),
    ("entropy", "entropy (nats/token)", (("train/entropy", "policy"),)),
    ("clip fraction", "fraction of tokens clipped", (("train/clip_frac", "PPO ratio clip"),)),
    ("response length", "tokens", (("rollout/response_len", "mean"), ("rollout/response_len_max", "max"))),
)
_PASS_K = re.compile(r"^eval/pass@(\d+)$")


def _points(recs: list[dict], key: str) -> list[tuple[float, float]]:
    """(step, value) of every record with a finite number under ``key``."""
    return [
        (r["step"], float(r[key]))
        for r in recs
        if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])
    ]


def panels_for(recs: list[dict]) -> list[tuple[str, str, list[tuple[str, list[tuple[float, float]]]]]]:
    """The panels a run's records fill: ``(title, y label, [(legend label, points), ...])``, only
    the series with points, only the panels with a series."""
    pass_k = sorted(
        {int(m.group(1)) for r in recs for k in r if (m := _PASS_K.match(k)) and m.group(1) != "1"}
    )
    out = []
    for title, ylabel, series in PANELS:
        extra = tuple((f"eval/pass@{k}", f"held-out pass@{k}") for k in pass_k) if title == "accuracy" else ()
        filled = [(label, pts) for key, label in series + extra if (pts := _points(recs, key))]
        if filled:
            out.append((title, ylabel, filled))
    return out


def _title(run_dir: Path, recs: list[dict]) -> str:
    """``megarl run <dir>: <estimator> / <policy loss>, steps a-b`` (what the resolved config names)."""
    what = ""
    cfg_path = run_dir / "config.resolved.yaml"
    if cfg_path.is_file():
        try:
            import yaml

            cfg = yaml.safe_load(cfg_path.read_text()) or {}
            est = (cfg.get("advantage") or {}).get("estimator")
            loss = (cfg.get("objective") or {}).get("policy_loss")
            what = " / ".join(str(x) for x in (est, loss) if x)
        except (OSError, ValueError, AttributeError, yaml.YAMLError):
            what = ""
    steps = [r["step"] for r in recs if isinstance(r.get("step"), int)]
    span = f"steps {min(steps)}-{max(steps)}" if steps else ""
    return f"megarl run {run_dir.name}" + (f": {what}" if what else "") + (f", {span}" if span else "")


def plot_run(run_dir: str | os.PathLike) -> Path | None:
    """Write ``run_dir/curves.png``; returns its path (None when there is nothing to plot)."""
    run_dir = Path(run_dir)
    recs = read_metrics(run_dir)
    panels = panels_for(recs)
    if not panels:
        return None
    out = run_dir / "curves.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _raster_png({k: _points(recs, k) for k, _ in _SERIES}, out)
        return out
    ncols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.0 * ncols, 3.2 * nrows + 0.6), squeeze=False)
    for ax, (title, ylabel, series) in zip(axes.flat, panels):
        for label, pts in series:
            xs, ys = zip(*pts)
            held_out = label.startswith("held-out")
            ax.plot(xs, ys, label=label, marker="o" if held_out else None, markersize=4)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if title == "accuracy":
            ax.set_ylim(-0.02, 1.02)
        if len(series) > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(_title(run_dir, recs))
    fig.tight_layout()
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def _raster_png(series: dict, out: Path, W: int = 640, H: int = 360, pad: int = 30) -> None:
    """Lines for each series (y in [0, 1]) with axes and a 0.1 grid; colours as in ``_SERIES``."""
    px = [[(255, 255, 255)] * W for _ in range(H)]
    max_step = max((s for v in series.values() for s, _ in v), default=1) or 1

    def to_xy(step: float, y: float) -> tuple[int, int]:
        x = pad + int((W - 2 * pad) * step / max_step)
        yy = H - pad - int((H - 2 * pad) * max(0.0, min(1.0, y)))
        return x, yy

    for g in range(11):
        _, yy = to_xy(0, g / 10)
        for x in range(pad, W - pad):
            px[yy][x] = (225, 225, 225) if g % 5 else (160, 160, 160)
    for y in range(pad, H - pad + 1):
        px[y][pad] = (0, 0, 0)

    def line(a, b, c):
        (x0, y0), (x1, y1) = a, b
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(n + 1):
            x, y = x0 + (x1 - x0) * i // n, y0 + (y1 - y0) * i // n
            for dx in (0, 1):
                for dy in (0, 1):
                    if 0 <= y + dy < H and 0 <= x + dx < W:
                        px[y + dy][x + dx] = c

    for k, color in _SERIES:
        pts = [to_xy(s, v) for s, v in series.get(k, [])]
        for a, b in itertools.pairwise(pts):
            line(a, b, color)
        for p in pts if k.startswith("eval") else []:
            line((p[0] - 3, p[1]), (p[0] + 3, p[1]), color)
    raw = b"".join(b"\x00" + bytes(v for pix in row for v in pix) for row in px)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
        )

    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(png)
    os.replace(tmp, out)
