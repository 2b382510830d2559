"""``python -m megarl.methods.allocation.mass_cli IN.jsonl --out OUT.jsonl --budget B``: MASS's
selection as a data step (megarl/methods/allocation/mass.py), or ``--random`` for the baseline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from megarl.methods.allocation.mass import MASSKnobs, mass_select, ngram_embeddings, read_rows


def main(argv: list[str] | None = None) -> int:
    """``python -m megarl.methods.allocation.mass IN.jsonl --out OUT.jsonl --budget B [knobs]``."""
    ap = argparse.ArgumentParser(description="MASS: select B rows of a JSONL dataset by coverage")
    ap.add_argument("data", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--quality-field", default="", help="a numeric row field >= 0 (default: all 1)")
    d = MASSKnobs()
    for key in ("groups", "dim", "features", "k", "steps", "embed_dim"):
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=getattr(d, key))
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--split", choices=("size", "sqrt"), default=d.split)
    ap.add_argument("--weight", choices=("idf", "activation"), default=d.weight)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random", action="store_true", help="the baseline: a uniform random subset (seeded)")
    a = ap.parse_args(argv)
    rows, texts, qs = read_rows(a.data, a.quality_field)
    if not (1 <= a.budget <= len(rows)):
        raise SystemExit(f"--budget {a.budget}: need 1 <= budget <= {len(rows)} rows of {a.data}")
    if a.random:
        pick = sorted(
            torch.randperm(len(rows), generator=torch.Generator().manual_seed(a.seed))[: a.budget].tolist()
        )
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text("".join(json.dumps(rows[i]) + "\n" for i in pick))
        print(f"{len(pick)} of {len(rows)} rows (uniform random) -> {a.out}")
        return 0
    sel = mass_select(
        ngram_embeddings(texts, a.embed_dim),
        torch.tensor(qs),
        a.budget,
        a.groups,
        a.dim,
        a.features,
        a.k,
        a.steps,
        a.lr,
        a.split,
        a.weight,
        a.seed,
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(json.dumps(rows[i]) + "\n" for i in sel.selected))
    print(f"{len(sel.selected)} of {len(rows)} rows -> {a.out}; group budgets {sel.budgets}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
