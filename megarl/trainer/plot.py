"""End-of-run curves as a PNG: reward mean per step (blue), held-out accuracy of samples at the
rollout temperature (green) and held-out greedy pass@1 (red).

Uses matplotlib when installed; otherwise a small built-in rasteriser (lines on a white canvas,
no text) written with zlib, so the quickstart always leaves a picture of its reward curve.
"""

from __future__ import annotations

import itertools
import os
import struct
import zlib
from pathlib import Path

from megarl.trainer.metrics import read_metrics

_SERIES = (
    ("reward/mean", (31, 119, 180)),
    ("eval/sampled_acc", (44, 160, 44)),
    ("eval/pass@1", (214, 39, 40)),
)


def plot_run(run_dir: str | os.PathLike) -> Path | None:
    """Write ``run_dir/curves.png``; returns its path (None when there is nothing to plot)."""
    recs = read_metrics(run_dir)
    series = {k: [(r["step"], r[k]) for r in recs if r.get(k) is not None] for k, _ in _SERIES}
    if not any(series.values()):
        return None
    out = Path(run_dir) / "curves.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for k, color in _SERIES:
            if series[k]:
                xs, ys = zip(*series[k])
                ax.plot(
                    xs,
                    ys,
                    label=k,
                    color=[c / 255 for c in color],
                    marker="o" if k.startswith("eval") else None,
                )
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out)
        plt.close(fig)
        return out
    except ImportError:
        pass
    _raster_png(series, out)
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
