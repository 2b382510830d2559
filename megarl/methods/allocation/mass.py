"""MASS: coarse-to-fine manifold + sparse-feature coverage data selection (formulas:
reference/allocation.py; reconstructed).

Per sample an embedding e in R^D and a quality q >= 0; a budget B.

1. A dense autoencoder z = tanh(e W1 + b1) in R^d, decoder z W2 + b2 (MSE, full-batch Adam), and
   k-means (k-means++ seeding, Lloyd iterations) on z: M groups.
2. Per group a TopK sparse autoencoder: h = TopK(e We + b) (the K largest pre-activations kept,
   the others 0: exactly K non-zeros), reconstruction h Wd (MSE). Active features F(e) = supp(h).
3. Budget split B_g proportional to |g| (or sqrt |g|), largest remainder, capped at |g| (the excess
   goes to the other groups in the same way).
4. Greedy coverage in each group: repeatedly pick argmax_x q(x) sum_{f in F(x), f not covered}
   u_f (u_f: the feature's IDF log((1 + N_g) / (1 + df_f)), or the sample's |h_f|), ties to the
   lower index; once nothing adds coverage, the rest of the group's budget goes by quality.

``python -m megarl.methods.allocation.mass_cli IN.jsonl --out OUT.jsonl --budget B`` writes the selected
rows (an SFT set for the warm-up, or a training set); the ``mass`` method trains a run's RL steps on
the MASS selection of its own training rows (a ``PromptChooser``). Embeddings: hashed character
n-gram counts of prompt + answer (``ngram_embeddings``), or any [N, D] tensor given to
``mass_select``.
"""

from __future__ import annotations

import json
import math
import random
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.plugin.allocation import GroupOutcome
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodParts, MethodSpec


def ngram_embeddings(texts: list[str], dim: int = 256, orders: tuple[int, ...] = (1, 2, 3)) -> torch.Tensor:
    """Hashed character n-gram counts (crc32 buckets), L2-normalised; [N, dim] float64."""
    out = torch.zeros(len(texts), dim, dtype=torch.float64)
    for i, t in enumerate(texts):
        for n in orders:
            for j in range(len(t) - n + 1):
                out[i, zlib.crc32(t[j : j + n].encode()) % dim] += 1.0
    return out / out.norm(dim=1, keepdim=True).clamp(min=1e-12)


def _adam(params: list[torch.Tensor], loss_fn, steps: int, lr: float, b1=0.9, b2=0.999, eps=1e-8) -> None:
    """``steps`` full-batch Adam steps on ``loss_fn()`` (written out: no optimizer object to build)."""
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t in range(1, steps + 1):
        grads = torch.autograd.grad(loss_fn(), params)
        with torch.no_grad():
            for p, g, mi, vi in zip(params, grads, m, v):
                mi.mul_(b1).add_(g, alpha=1 - b1)
                vi.mul_(b2).addcmul_(g, g, value=1 - b2)
                p.sub_(lr * (mi / (1 - b1**t)) / ((vi / (1 - b2**t)).sqrt() + eps))


def dense_codes(E: torch.Tensor, d: int, steps: int, lr: float, gen: torch.Generator) -> torch.Tensor:
    """The dense autoencoder's coordinates z [N, d] of ``E`` after ``steps`` training steps."""
    D = E.shape[1]
    W1 = (torch.randn(D, d, generator=gen, dtype=E.dtype) / math.sqrt(D)).requires_grad_()
    W2 = (torch.randn(d, D, generator=gen, dtype=E.dtype) / math.sqrt(d)).requires_grad_()
    b1 = torch.zeros(d, dtype=E.dtype, requires_grad=True)
    b2 = torch.zeros(D, dtype=E.dtype, requires_grad=True)
    _adam([W1, W2, b1, b2], lambda: ((torch.tanh(E @ W1 + b1) @ W2 + b2 - E) ** 2).mean(), steps, lr)
    with torch.no_grad():
        return torch.tanh(E @ W1 + b1)


def kmeans(Z: torch.Tensor, M: int, gen: torch.Generator, iters: int = 100) -> torch.Tensor:
    """Group labels [N] in [0, M): k-means++ seeding from ``gen``, then Lloyd iterations until no
    label changes (an empty group keeps its centre)."""
    N = Z.shape[0]
    M = min(M, N)
    first = int(torch.randint(N, (1,), generator=gen))
    centres = [Z[first]]
    for _ in range(1, M):
        d2 = torch.stack([((Z - c) ** 2).sum(1) for c in centres]).min(0).values
        if float(d2.sum()) <= 0:
            nxt = len(centres)  # all points coincide with centres: any other point
        else:
            nxt = int(torch.multinomial(d2 / d2.sum(), 1, generator=gen))
        centres.append(Z[nxt])
    C = torch.stack(centres)
    labels = torch.full((N,), -1, dtype=torch.long)
    for _ in range(iters):
        new = torch.cdist(Z, C).argmin(1)
        if bool((new == labels).all()):
            break
        labels = new
        for g in range(M):
            if bool((labels == g).any()):
                C[g] = Z[labels == g].mean(0)
    return labels


def topk(pre: torch.Tensor, K: int) -> torch.Tensor:
    """The K largest entries of each row of ``pre`` kept, the others 0 (exactly K non-zeros when
    the kept values are non-zero)."""
    idx = pre.topk(K, dim=1).indices
    return torch.zeros_like(pre).scatter(1, idx, pre.gather(1, idx))


def sae_codes(
    E: torch.Tensor, features: int, K: int, steps: int, lr: float, gen: torch.Generator
) -> torch.Tensor:
    """A TopK sparse autoencoder's codes h [N, features] of ``E`` after ``steps`` training steps."""
    D = E.shape[1]
    K = min(K, features)
    We = (torch.randn(D, features, generator=gen, dtype=E.dtype) / math.sqrt(D)).requires_grad_()
    Wd = (torch.randn(features, D, generator=gen, dtype=E.dtype) / math.sqrt(features)).requires_grad_()
    b = torch.zeros(features, dtype=E.dtype, requires_grad=True)
    _adam([We, Wd, b], lambda: ((topk(E @ We + b, K) @ Wd - E) ** 2).mean(), steps, lr)
    with torch.no_grad():
        return topk(E @ We + b, K)


def split_budget(sizes: list[int], budget: int, mode: str = "size") -> list[int]:
    """B_g proportional to |g| (``size``) or sqrt |g| (``sqrt``), largest remainder (ties: lower
    index), capped at |g|; what a cap leaves goes to the other groups the same way."""
    if budget > sum(sizes):
        raise ValueError(f"budget {budget} exceeds the {sum(sizes)} samples")
    out = [0] * len(sizes)
    left = budget
    while left > 0:
        open_ = [g for g in range(len(sizes)) if out[g] < sizes[g]]
        w = [math.sqrt(sizes[g]) if mode == "sqrt" else float(sizes[g]) for g in open_]
        raw = [left * x / sum(w) for x in w]
        add = [int(r) for r in raw]
        order = sorted(range(len(open_)), key=lambda i: (-(raw[i] - add[i]), open_[i]))
        for i in order[: left - sum(add)]:
            add[i] += 1
        for i, g in enumerate(open_):
            take = min(add[i], sizes[g] - out[g])
            out[g] += take
            left -= take
    return out


def greedy_coverage(
    q: torch.Tensor, h: torch.Tensor, budget: int, weight: str = "idf"
) -> tuple[list[int], list[float]]:
    """(picked rows in order, their marginal gains): argmax q(x) sum_{f in F(x), uncovered} u_f,
    ties to the lower row; after coverage is exhausted (every gain 0) the rest by quality."""
    N = h.shape[0]
    active = h != 0
    if weight == "idf":
        df = active.sum(0).double()
        u = torch.log((1.0 + N) / (1.0 + df)).expand(N, -1) * active
    elif weight == "activation":
        u = h.abs().double()
    else:
        raise ValueError(f"weight={weight!r}; allowed: idf, activation")
    covered = torch.zeros(h.shape[1], dtype=torch.bool)
    taken = torch.zeros(N, dtype=torch.bool)
    picked, gains = [], []
    qd = q.double()
    for _ in range(budget):
        gain = qd * (u * ~covered).sum(1)
        gain[taken] = -1.0
        best = float(gain.max())
        if best <= 0:
            rest = [i for i in sorted(range(N), key=lambda i: (-float(qd[i]), i)) if not taken[i]]
            picked += rest[: budget - len(picked)]
            gains += [0.0] * (budget - len(gains))
            break
        i = int((gain >= best * (1 - 1e-12)).nonzero()[0])  # ties (to rounding): the lower row
        picked.append(i)
        gains.append(best)
        taken[i] = True
        covered |= active[i]
    return picked, gains


@dataclass
class MASSSelection:
    """The selected rows (sorted), each group's labels, budgets and picks, and per-group gains."""

    selected: list[int]
    labels: list[int]
    budgets: list[int]
    picks: list[list[int]]
    gains: list[list[float]]


def mass_select(
    E: torch.Tensor,
    q: torch.Tensor,
    budget: int,
    groups: int = 4,
    dim: int = 16,
    features: int = 64,
    k: int = 8,
    steps: int = 200,
    lr: float = 1e-2,
    split: str = "size",
    weight: str = "idf",
    seed: int = 0,
) -> MASSSelection:
    """MASS's selection of ``budget`` rows of ``E`` [N, D] with qualities ``q`` [N] (see the module
    docstring); every random draw comes from one generator seeded by ``seed``."""
    if bool((q < 0).any()):
        raise ValueError("qualities must be >= 0")
    gen = torch.Generator().manual_seed(seed)
    E = E.double()
    labels = (
        kmeans(dense_codes(E, dim, steps, lr, gen), groups, gen)
        if groups > 1
        else torch.zeros(len(E), dtype=torch.long)
    )
    members = [torch.nonzero(labels == g).flatten().tolist() for g in range(int(labels.max()) + 1)]
    budgets = split_budget([len(m) for m in members], budget, split)
    picks, gains = [], []
    for rows, b in zip(members, budgets):
        if not rows or b == 0:
            picks.append([])
            gains.append([])
            continue
        h = sae_codes(E[rows], features, k, steps, lr, gen)
        p, g = greedy_coverage(q[rows], h, b, weight)
        picks.append([rows[i] for i in p])
        gains.append(g)
    return MASSSelection(sorted(i for p in picks for i in p), labels.tolist(), budgets, picks, gains)


def read_rows(path: Path, quality_field: str) -> tuple[list[dict], list[str], list[float]]:
    """A JSONL file's rows, their texts (prompt + answer) and qualities (``quality_field``, 1.0 when
    empty); errors name the file, line and field."""
    rows, texts, qs = [], [], []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i + 1}: not JSON ({e})") from None
        if not isinstance(r, dict) or "prompt" not in r:
            raise ValueError(f"{path}:{i + 1}: a row needs the field 'prompt'")
        q = 1.0
        if quality_field:
            if (
                quality_field not in r
                or not isinstance(r[quality_field], (int, float))
                or r[quality_field] < 0
            ):
                raise ValueError(f"{path}:{i + 1}: field {quality_field!r} must be a number >= 0")
            q = float(r[quality_field])
        rows.append(r)
        texts.append(f"{r['prompt']} {r.get('answer', '')}")
        qs.append(q)
    return rows, texts, qs


@dataclass
class MASSKnobs(Knobs):
    """MASS's budget and selection settings (``method`` section)."""

    budget: int = 256  # rows selected from the run's training set
    groups: int = 4  # k-means groups on the dense autoencoder's coordinates (1: global coverage)
    dim: int = 16  # dense autoencoder width d
    features: int = 64  # TopK SAE features per group
    k: int = 8  # active features per sample
    steps: int = 200  # training steps of each autoencoder
    lr: float = 1e-2
    split: str = "size"  # budget per group proportional to its size, or "sqrt"
    weight: str = "idf"  # coverage weight of a feature: "idf" or the sample's "activation"
    embed_dim: int = 256  # hashed character n-gram buckets

    def check(self) -> None:
        """Positive sizes; k <= features; split and weight named."""
        for key in ("budget", "groups", "dim", "features", "k", "steps", "embed_dim"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if self.k > self.features:
            raise ValueError(f"k={self.k} must be <= features={self.features}")
        if self.split not in ("size", "sqrt"):
            raise ValueError(f"split={self.split!r}; allowed: size, sqrt")
        if self.weight not in ("idf", "activation"):
            raise ValueError(f"weight={self.weight!r}; allowed: idf, activation")


class MASSChooser:
    """A prompt chooser over the MASS selection of the run's training rows: each step's prompts
    come from a shuffled pass over the selection (seeded by the run's seed and the pass)."""

    def __init__(self, selected: list[int], want: int):
        self.selected, self.want = selected, want
        self.cursor = [0, 0]  # [pass, position]
        self.seed = 0

    def keep(self, rewards: torch.Tensor) -> bool:
        """Every group stays."""
        return True

    def more(self, kept: int, rounds: int) -> bool:
        """One round per step."""
        return False

    def bind(self, tasks: list[str], seed: int) -> None:
        """The run's seed (the selection was made at build time)."""
        self.seed = seed

    def next_prompts(self, step: int, count: int) -> list[int]:
        """The next ``count`` rows of the shuffled passes over the selection."""
        out: list[int] = []
        while len(out) < count:
            order = list(self.selected)
            random.Random(self.seed * 1_000_003 + self.cursor[0]).shuffle(order)
            take = min(count - len(out), len(order) - self.cursor[1])
            out += order[self.cursor[1] : self.cursor[1] + take]
            self.cursor[1] += take
            if self.cursor[1] >= len(order):
                self.cursor = [self.cursor[0] + 1, 0]
        return out

    def observe(self, step: int, groups: list[GroupOutcome]) -> dict[str, float]:
        """The selection's size and the pass."""
        return {"mass/selected": float(len(self.selected)), "mass/pass": float(self.cursor[0])}

    def state_dict(self) -> dict:
        """The cursor (the selection is recomputed, deterministically, at build)."""
        return {"cursor": list(self.cursor), "selected": len(self.selected)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the cursor; a selection of another size is refused."""
        if state["selected"] != len(self.selected):
            raise ValueError(
                f"checkpoint MASS selection has {state['selected']} rows, this run's {len(self.selected)}"
            )
        self.cursor = [int(x) for x in state["cursor"]]


def build(ctx, knobs: MASSKnobs) -> MethodParts:
    """The MASS selection of the run's training rows and its chooser."""
    rows = ctx.dataset.rows
    if knobs.budget > len(rows):
        raise ValueError(f"method.budget={knobs.budget} exceeds the {len(rows)} training rows")
    E = ngram_embeddings([f"{r.prompt} {r.answer}" for r in rows], knobs.embed_dim)
    sel = mass_select(
        E,
        torch.ones(len(rows)),
        knobs.budget,
        knobs.groups,
        knobs.dim,
        knobs.features,
        knobs.k,
        knobs.steps,
        knobs.lr,
        knobs.split,
        knobs.weight,
        ctx.cfg.schedule.seed,
    )
    return MethodParts(allocator=MASSChooser(sel.selected, ctx.cfg.schedule.prompts_per_step))


SPEC = MethodSpec(
    name="mass",
    summary="MASS: train on a coverage-selected subset (autoencoder groups, TopK-SAE feature coverage)",
    provenance="reconstructed",
    knobs=MASSKnobs,
    build=build,
)
