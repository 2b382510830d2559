"""Curve agreement that one spike cannot dominate: rank correlation, correlation without the fault
steps and the fault steps' share of it, ratio of mean magnitudes, the worst step-wise ratio, and
the steps where the proxy diverges with no detector event (megarl.faults.fidelity reports them).

A single injected spike present in both runs makes Pearson r close to 1 whatever the other steps
do, and a proxy-only blow-up inside the detectors' warm-up fires no event; these numbers show both.
"""

from __future__ import annotations

import math

# magnitudes below this count as zero noise (the detectors' absolute spike floor, spike_min_abs_std)
FLOOR = 1.0e-4
# a step diverges when |proxy - original| exceeds this times max(|original|, median |original|, FLOOR)
DIVERGENCE = 1.0


def pearson(a: list[float], b: list[float]) -> float | None:
    """Pearson correlation; None with fewer than 3 points or a constant series."""
    n = len(a)
    if n < 3:
        return None
    ma, mb = sum(a) / n, sum(b) / n
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    if va <= 0 or vb <= 0:
        return None
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / math.sqrt(va * vb)


def _ranks(xs: list[float]) -> list[float]:
    """Average ranks (ties share the mean of their positions)."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman rank correlation (Pearson of average ranks)."""
    return pearson(_ranks(a), _ranks(b))


def fault_share(a: list[float], b: list[float], fault: list[bool]) -> float | None:
    """The fault steps' share of the co-variation sum(x - mean)(y - mean) behind Pearson r (1: r
    comes from the fault steps alone; can fall outside [0, 1] when other steps anti-correlate)."""
    n = len(a)
    if n < 3 or not any(fault):
        return None if n < 3 else 0.0
    ma, mb = sum(a) / n, sum(b) / n
    terms = [(x - ma) * (y - mb) for x, y in zip(a, b)]
    total = sum(terms)
    if total == 0:
        return None
    return sum(t for t, f in zip(terms, fault) if f) / total


def mean_abs_ratio(a: list[float], b: list[float]) -> float | None:
    """mean |proxy| / mean |original|."""
    ma = sum(abs(x) for x in a) / len(a)
    return (sum(abs(y) for y in b) / len(b)) / ma if ma > 0 else None


def worst_step_ratio(steps: list[int], a: list[float], b: list[float]) -> dict | None:
    """The step whose |proxy| / |original| is farthest from 1 (magnitudes floored at FLOOR)."""
    best = None
    for s, x, y in zip(steps, a, b):
        r = max(abs(y), FLOOR) / max(abs(x), FLOOR)
        far = max(r, 1 / r)
        if best is None or far > best[0]:
            best = (far, {"step": s, "ratio": r, "original": x, "proxy": y})
    return best[1] if best else None


def agreement(steps: list[int], a: list[float], b: list[float], fault_steps: set[int]) -> dict:
    """All agreement numbers of one curve (original ``a``, proxy ``b`` over ``steps``)."""
    fault = [s in fault_steps for s in steps]
    keep = [i for i, f in enumerate(fault) if not f]
    return {
        "spearman_rho": spearman(a, b),
        "fault_steps": [s for s, f in zip(steps, fault) if f],
        "pearson_r_without_fault_steps": pearson([a[i] for i in keep], [b[i] for i in keep]),
        "fault_step_share": fault_share(a, b, fault),
        "mean_ratio": mean_abs_ratio(a, b),
        "worst_step_ratio": worst_step_ratio(steps, a, b),
    }


def divergences(row: dict, event_steps: set[int]) -> list[dict]:
    """Steps of one curve row (steps, original, proxy) where the proxy is off by more than
    DIVERGENCE x max(|original|, median |original|, FLOOR) and neither run had an event."""
    mags = sorted(abs(x) for x in row["original"])
    median = mags[len(mags) // 2] if mags else 0.0
    out = []
    for s, x, y in zip(row["steps"], row["original"], row["proxy"]):
        scale = max(abs(x), median, FLOOR)
        if s not in event_steps and abs(y - x) > DIVERGENCE * scale:
            out.append({"step": s, "key": row["key"], "label": row["label"], "original": x, "proxy": y})
    return out
