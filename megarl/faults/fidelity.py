"""Fidelity of a proxy run to the original run: per-curve agreement, events, cost; markdown + PNG.

Inputs are two run directories of ``megarl train`` (their ``metrics.jsonl``). For every curve
(loss, reward, grad norm, entropy, logprob gaps, router imbalance) over the steps both runs logged
a finite value: Pearson correlation, mean and max absolute difference, the relative divergence
``mean |proxy - original| / mean |original|``, and the numbers a single spike cannot dominate
(megarl.faults.agreement: Spearman, r without the fault steps and their share of r, ratio of mean
magnitudes, the worst step-wise ratio). Fault events are matched by (step, type); steps where a
curve diverges with no event in either run are listed next to the verdict. Step times leave out
the steps that wrote a dump.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from megarl.faults.agreement import agreement, divergences, pearson
from megarl.rundir import read_metrics

# (metric key, label). ``router/imbalance`` is derived: the mean over MoE layers of max-load x E.
CURVES: tuple[tuple[str, str], ...] = (
    ("train/loss", "loss"),
    ("reward/mean", "reward (mean)"),
    ("train/grad_norm", "grad norm"),
    ("train/entropy", "entropy (nats/token)"),
    ("train/train_rollout_logprob_gap", "train vs rollout logprob gap"),
    ("faults/logprob_gap_first", "train vs rollout gap, first update of a step"),
    ("rollout/logprob_gap_old", "learner vs engine logprob gap"),
    ("router/imbalance", "router load imbalance (max/mean, layer mean)"),
    ("router/load_entropy", "router load entropy (normalised, layer mean)"),
)


def _layer_mean(rec: dict, suffix: str) -> float | None:
    vals = [
        v
        for k, v in rec.items()
        if k.startswith("router/layer") and k.endswith(suffix) and isinstance(v, float)
    ]
    return sum(vals) / len(vals) if vals else None


def curve(recs: list[dict], key: str) -> dict[int, float]:
    """{step: value} of ``key`` over the training steps (step >= 1) with a finite value."""
    out = {}
    for r in recs:
        s = r.get("step", 0)
        if s < 1:
            continue
        v = (
            _layer_mean(r, "/" + key.split("/", 1)[1])
            if key.startswith("router/") and "layer" not in key
            else r.get(key)
        )
        if isinstance(v, (int, float)) and math.isfinite(v):
            out[int(s)] = float(v)
    return out


def fault_steps(*runs: list[dict]) -> set[int]:
    """Steps where any of ``runs`` had an injection active or an event."""
    return {int(r["step"]) for recs in runs for r in recs if r.get("faults/injected") or r.get("events")}


def compare_curves(orig: list[dict], proxy: list[dict]) -> list[dict]:
    """One row per curve present in both runs: steps, r, mean/max |diff|, relative divergence,
    and the agreement numbers of megarl.faults.agreement (fault steps: injections or events)."""
    faulty = fault_steps(orig, proxy)
    rows = []
    for key, label in CURVES:
        a, b = curve(orig, key), curve(proxy, key)
        steps = sorted(set(a) & set(b))
        if not steps:
            continue
        xa, xb = [a[s] for s in steps], [b[s] for s in steps]
        diffs = [abs(x - y) for x, y in zip(xa, xb)]
        scale = sum(abs(x) for x in xa) / len(xa)
        rows.append(
            {
                "key": key,
                "label": label,
                "steps": steps,
                "original": xa,
                "proxy": xb,
                "pearson_r": pearson(xa, xb),
                "mean_abs_diff": sum(diffs) / len(diffs),
                "max_abs_diff": max(diffs),
                "relative_divergence": (sum(diffs) / len(diffs)) / scale if scale > 0 else None,
                **agreement(steps, xa, xb, faulty),
            }
        )
    return rows


def events_of(recs: list[dict]) -> list[tuple[int, str]]:
    """(step, type) of every fault event of a run, in order."""
    return [(int(e["step"]), e["type"]) for r in recs for e in (r.get("events") or [])]


def run_cost(recs: list[dict]) -> dict:
    """Mean step / train time over the training steps of a run, leaving out the steps that wrote
    a dump (a dump's time is counted in its step)."""
    dumped = [int(r["step"]) for r in recs if r.get("step", 0) >= 1 and r.get("faults/dump")]
    steps = [r for r in recs if r.get("step", 0) >= 1 and not r.get("faults/dump")]
    st = [r["time/step"] for r in steps if isinstance(r.get("time/step"), (int, float))]
    tr = [r["time/train"] for r in steps if isinstance(r.get("time/train"), (int, float))]
    return {
        "steps": len(st),
        "dump_steps_excluded": dumped,
        "step_time_mean_s": sum(st) / len(st) if st else None,
        "train_time_mean_s": sum(tr) / len(tr) if tr else None,
    }


def cost_figures(orig: dict, proxy: dict, runs: dict) -> dict:
    """Per run: step and learner time without dump steps (``run_cost``), parameters and peak RSS
    (from ``runs``, the process facts of megarl.proxy.compare); proxy / original ratios; a note on
    what the peak includes."""
    out = {"original": dict(orig), "proxy": dict(proxy)}
    for name in out:
        for k in ("params", "peak_rss_mib"):
            if (runs.get(name) or {}).get(k) is not None:
                out[name][k] = runs[name][k]
    out["ratios"] = {
        k: out["proxy"][k] / out["original"][k]
        for k in ("step_time_mean_s", "train_time_mean_s", "params", "peak_rss_mib")
        if isinstance(out["original"].get(k), (int, float))
        and isinstance(out["proxy"].get(k), (int, float))
        and out["original"][k]
    }
    dumped = {
        n: out[n]["dump_steps_excluded"] for n in ("original", "proxy") if out[n]["dump_steps_excluded"]
    }
    note = "Step and learner times are means over the steps that wrote no dump."
    if "peak_rss_mib" in out["ratios"]:
        note += " Peak RSS is the maximum of the whole process (under torchrun: its largest worker)" + (
            ", dump steps included ("
            + "; ".join(f"{n}: {', '.join(map(str, v))}" for n, v in dumped.items())
            + "; a dump adds a copy of the weights): run without faults.dump_* for a figure without them."
            if dumped
            else "; no step wrote a dump."
        )
    out["note"] = note
    return out


def plot_fidelity(rows: list[dict], out_png: Path) -> Path:
    """Per curve: the two runs over steps (left) and proxy vs original with the y = x line (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(rows), 1)
    fig, axes = plt.subplots(
        n, 2, figsize=(9, 2.3 * n), squeeze=False, gridspec_kw={"width_ratios": [2.2, 1]}
    )
    for i, row in enumerate(rows):
        ax, sc = axes[i]
        ax.plot(row["steps"], row["original"], marker="o", ms=3, label="original", color="#1f77b4")
        ax.plot(row["steps"], row["proxy"], marker="s", ms=3, label="proxy", color="#d62728")
        ax.fill_between(row["steps"], row["original"], row["proxy"], color="#d62728", alpha=0.12)
        ax.set_title(row["label"], fontsize=9)
        ax.tick_params(labelsize=7)
        if i == 0:
            ax.legend(fontsize=7)
        if i == n - 1:
            ax.set_xlabel("step", fontsize=8)
        sc.scatter(row["original"], row["proxy"], s=10, color="#555555")
        lo = min(row["original"] + row["proxy"])
        hi = max(row["original"] + row["proxy"])
        sc.plot([lo, hi], [lo, hi], color="#999999", lw=0.8)
        r = row["pearson_r"]
        rd = row["relative_divergence"]
        sc.set_title(
            f"r={'n/a' if r is None else f'{r:.3f}'}  rel.div={'n/a' if rd is None else f'{rd:.3f}'}",
            fontsize=8,
        )
        sc.tick_params(labelsize=7)
        if i == n - 1:
            sc.set_xlabel("original", fontsize=8)
        sc.set_ylabel("proxy", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return out_png


def _fmt(x) -> str:
    return "n/a" if x is None else (f"{x:.4g}" if isinstance(x, float) else str(x))


def write_report(
    orig_dir: str | os.PathLike,
    proxy_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    extra: dict | None = None,
) -> dict:
    """Write ``out_dir/fidelity.md``, ``fidelity.png`` and ``fidelity.json``; returns the report.
    ``extra``: run facts to include (models, wall time, peak memory: see megarl.proxy.compare)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ro, rp = read_metrics(orig_dir), read_metrics(proxy_dir)
    if not any(r.get("step", 0) >= 1 for r in ro) or not any(r.get("step", 0) >= 1 for r in rp):
        raise ValueError(f"no training steps in {orig_dir}/metrics.jsonl or {proxy_dir}/metrics.jsonl")
    rows = compare_curves(ro, rp)
    eo, ep = events_of(ro), events_of(rp)
    event_steps = {s for s, _ in eo + ep}
    unseen = [d for r in rows for d in divergences(r, event_steps)]
    same = _types_by_step(eo) == _types_by_step(ep)
    coverage = routing_coverage((extra or {}).get("proxy", {}).get("model"))
    rep = {
        "curves": [{k: v for k, v in r.items() if k not in ("original", "proxy")} for r in rows],
        "series": {
            r["key"]: {"steps": r["steps"], "original": r["original"], "proxy": r["proxy"]} for r in rows
        },
        "events": {
            "original": eo,
            "proxy": ep,
            "same": eo == ep,
            "same_types_per_step": same,
        },
        "divergences": unseen,
        "verdict": verdict(same, unseen),
        "routing_coverage": coverage,
        "cost": cost_figures(run_cost(ro), run_cost(rp), extra or {}),
        "runs": extra or {},
    }
    png = plot_fidelity(rows, out / "fidelity.png")
    lines = ["# Proxy fidelity report", ""]
    runs = extra or {}
    if runs:
        lines += ["| | original | proxy |", "|---|---|---|"]
        for k in sorted({k for v in runs.values() if isinstance(v, dict) for k in v}):
            lines.append(
                f"| {k} | {_fmt(runs.get('original', {}).get(k))} | {_fmt(runs.get('proxy', {}).get(k))} |"
            )
        lines.append("")
    lines += [
        "## Training curves",
        "",
        "| curve | steps | Pearson r | Spearman | r without fault steps | fault steps' share of r "
        "| mean ratio | worst step ratio (step) | mean abs diff | max abs diff | relative divergence |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        w = r["worst_step_ratio"]
        lines.append(
            f"| {r['label']} | {len(r['steps'])} | {_fmt(r['pearson_r'])} | {_fmt(r['spearman_rho'])} | "
            f"{_fmt(r['pearson_r_without_fault_steps'])} | {_fmt(r['fault_step_share'])} | "
            f"{_fmt(r['mean_ratio'])} | {_fmt(w['ratio']) if w else 'n/a'} ({w['step'] if w else '-'}) | "
            f"{_fmt(r['mean_abs_diff'])} | {_fmt(r['max_abs_diff'])} | {_fmt(r['relative_divergence'])} |"
        )
    lines += [
        "",
        (
            "relative divergence = mean |proxy - original| / mean |original|; r = n/a for fewer than 3 "
            "finite points or a constant curve. Fault steps: steps with an injection or an event in "
            f"either run ({', '.join(map(str, sorted(fault_steps(ro, rp)))) or 'none'}); their share of r "
            "is their part of the co-variation sum behind Pearson r (1 = r comes from them alone). "
            "mean ratio = mean |proxy| / mean |original|; worst step ratio = the step's |proxy| / "
            "|original| farthest from 1 (magnitudes below 1e-4 count as 1e-4)."
        ),
        "",
        f"![fidelity]({png.name})",
        "",
        "## Fault events",
        "",
        "| step | original | proxy |",
        "|---|---|---|",
    ]
    bo, bp = _types_by_step(eo), _types_by_step(ep)
    for s in sorted(set(bo) | set(bp)):
        lines.append(f"| {s} | {', '.join(bo.get(s, [])) or '-'} | {', '.join(bp.get(s, [])) or '-'} |")
    if not bo and not bp:
        lines.append("| - | none | none |")
    lines += [
        "",
        f"Same event types at the same steps: **{'yes' if same else 'no'}**",
        "",
        f"Verdict: **{rep['verdict']}**",
        "",
    ]
    if coverage:
        lines += [
            "Proxy routing (prune report, original routing on the calibration tokens): routing mass "
            f"kept {_fmt(coverage.get('routing_mass_covered'))}, tokens with all experts kept "
            f"{_fmt(coverage.get('tokens_fully_covered'))}",
            "",
        ]
    lines += [
        "## Divergences no detector flagged",
        "",
        "Steps where |proxy - original| > max(|original|, median |original|, 1e-4) and neither run "
        "had an event (the detectors judge no spike during their warm-up steps).",
        "",
        "| step | curve | original | proxy |",
        "|---|---|---|---|",
    ]
    for d in unseen:
        lines.append(f"| {d['step']} | {d['label']} | {_fmt(d['original'])} | {_fmt(d['proxy'])} |")
    if not unseen:
        lines.append("| - | none | | |")
    lines += [
        "",
        "## Cost per step",
        "",
        "| | original | proxy | proxy / original |",
        "|---|---|---|---|",
    ]
    cost = rep["cost"]
    for k in ("step_time_mean_s", "train_time_mean_s", "params", "peak_rss_mib", "dump_steps_excluded"):
        o, p = cost["original"].get(k), cost["proxy"].get(k)
        if o is None and p is None:
            continue
        lines.append(f"| {k} | {_fmt(o)} | {_fmt(p)} | {_fmt(cost['ratios'].get(k))} |")
    lines += ["", cost["note"]]
    (out / "fidelity.md").write_text("\n".join(lines) + "\n")
    (out / "fidelity.json").write_text(json.dumps(rep, indent=1))
    return rep


def verdict(same_events: bool, unseen: list[dict]) -> str:
    """One line: do the events agree, and did a curve diverge where no detector fired."""
    if not same_events:
        return "events differ"
    if not unseen:
        return "events agree; no curve diverges at a step without an event"
    where = ", ".join(f"{d['label']} at step {d['step']}" for d in unseen[:5])
    more = f" and {len(unseen) - 5} more" if len(unseen) > 5 else ""
    return f"events agree, but {len(unseen)} step(s) diverge where no detector fired: {where}{more}"


def routing_coverage(proxy_model: str | None) -> dict | None:
    """``coverage_mean`` of the proxy's prune report (``proxy_report.json``), if it has one."""
    p = Path(proxy_model) / "proxy_report.json" if proxy_model else None
    if p is None or not p.is_file():
        return None
    return json.loads(p.read_text()).get("coverage_mean")


def _types_by_step(ev: list[tuple[int, str]]) -> dict[int, list[str]]:
    d: dict[int, list[str]] = {}
    for s, t in ev:
        d.setdefault(s, [])
        if t not in d[s]:
            d[s].append(t)
    return {s: sorted(v) for s, v in d.items()}
