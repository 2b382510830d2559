"""``python -m megarl.methods.allocation.trajval_cli PROBE_RUN_DIR --out prior.json``: TrajVal's
task prior from a probe run (megarl/methods/allocation/trajval.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megarl.methods.allocation.trajval import value_probe


def main(argv: list[str] | None = None) -> int:
    """``python -m megarl.methods.allocation.trajval PROBE_RUN_DIR --out FILE [knobs]``."""
    ap = argparse.ArgumentParser(description="TrajVal: a task prior from a probe run's per-task evaluations")
    ap.add_argument("probe_run", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--beta", type=float, default=1.0)
    ap.add_argument("--eps0", type=float, default=0.01)
    ap.add_argument("--n0", type=float, default=0.0)
    ap.add_argument("--no-headroom", action="store_true", help="l = max(0, gain), not divided by 1 - acc0")
    a = ap.parse_args(argv)
    d = value_probe(a.probe_run, a.beta, a.eps0, a.n0, not a.no_headroom)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(d, indent=1) + "\n")
    for t, v in d["tasks"].items():
        acc = f"acc {v['acc0']:.3f} -> {v['acc1']:.3f}"
        print(f"{t}: {acc}  learnability {v['learnability']:.3f}  prior {v['prior']:.3f}")
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
