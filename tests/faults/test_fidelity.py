"""The fidelity report on two hand-written metrics.jsonl files shaped like a real compare: a
proxy-only grad-norm blow-up at step 2 that no detector saw, and an injected loss spike at step 6
on both runs that alone makes the loss curves correlate."""

import json
import math
from pathlib import Path

from megarl.faults.fidelity import write_report

STEPS = range(1, 13)
LOSS_NOISE = [0.3, -0.5, 0.8, -0.2, 0.1, 0.0, -0.7, 0.4, 0.9, -0.3, 0.2, -0.6]
LOSS_NOISE_PROXY = [-0.4, 0.6, 0.1, 0.5, -0.8, 0.0, 0.3, -0.2, -0.5, 0.7, -0.1, 0.4]


def write_run(d: Path, proxy: bool) -> Path:
    d.mkdir(parents=True)
    rows = [{"step": 0}]
    for s in STEPS:
        i = s - 1
        r = {
            "step": s,
            "train/loss": 1e-7 * (LOSS_NOISE_PROXY[i] if proxy else LOSS_NOISE[i]),
            "train/grad_norm": 3.6 + 0.1 * math.sin(s) + (0.05 if proxy else 0.0),
            "reward/mean": 0.1 + 0.02 * s,
            "time/step": 1.0 if proxy else 2.0,
            "time/train": 0.5 if proxy else 1.0,
        }
        if proxy and s == 2:
            r["train/grad_norm"] = 408.8  # inside the detectors' warm-up: no event
        if s == 6:
            r["train/loss"] = -7.9e-3 * (1.1 if proxy else 1.0)
            r["faults/injected"] = ["poison"]
            r["events"] = [{"type": "loss_spike", "step": 6, "detail": {}}]
        if s == 9:  # a dump step: its time holds the dump
            r["faults/dump"] = str(d / "dumps" / "step_000009")
            r["time/step"] += 30.0
        rows.append(r)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return d


def report(tmp_path: Path) -> dict:
    proxy_model = tmp_path / "proxy-model"
    proxy_model.mkdir()
    (proxy_model / "proxy_report.json").write_text(
        json.dumps({"coverage_mean": {"routing_mass_covered": 0.494, "tokens_fully_covered": 0.19}})
    )
    return write_report(
        write_run(tmp_path / "o", False),
        write_run(tmp_path / "p", True),
        tmp_path / "out",
        extra={
            "original": {"model": str(tmp_path / "x"), "params": 1000, "peak_rss_mib": 800.0},
            "proxy": {"model": str(proxy_model), "params": 250, "peak_rss_mib": 200.0},
        },
    )


def test_a_single_fault_step_does_not_pass_for_agreement(tmp_path):
    rep = report(tmp_path)
    loss = next(c for c in rep["curves"] if c["key"] == "train/loss")
    assert loss["fault_steps"] == [6]
    assert loss["pearson_r"] > 0.99  # the spike alone
    assert loss["pearson_r_without_fault_steps"] < 0.5  # the noise around it does not correlate
    assert loss["fault_step_share"] > 0.9  # of the co-variation behind r
    grad = next(c for c in rep["curves"] if c["key"] == "train/grad_norm")
    # one blow-up drags Pearson down while the ranks still agree: the report shows both
    assert grad["pearson_r"] < 0.5 and grad["spearman_rho"] > 0.9
    assert grad["mean_ratio"] > 5  # proxy mean / original mean
    assert grad["worst_step_ratio"]["step"] == 2
    assert abs(grad["worst_step_ratio"]["ratio"] - 408.8 / (3.6 + 0.1 * math.sin(2))) < 1e-6


def test_divergences_no_detector_saw_are_flagged_next_to_the_verdict(tmp_path):
    rep = report(tmp_path)
    assert rep["events"]["same_types_per_step"]
    flagged = [(d["step"], d["key"]) for d in rep["divergences"]]
    assert (2, "train/grad_norm") in flagged
    assert all(d["step"] != 6 for d in rep["divergences"])  # the fault step has its event
    assert rep["verdict"].startswith("events agree, but"), rep["verdict"]
    md = (tmp_path / "out" / "fidelity.md").read_text()
    assert "Divergences no detector flagged" in md and "| 2 | grad norm |" in md
    assert "routing mass kept 0.494" in md and "tokens with all experts kept 0.19" in md
    assert "Spearman" in md and "r without fault steps" in md and "worst step ratio" in md


def test_cost_leaves_out_dump_steps(tmp_path):
    rep = report(tmp_path)
    c = rep["cost"]["original"]
    assert c["dump_steps_excluded"] == [9]
    assert c["step_time_mean_s"] == 2.0 and c["steps"] == 11
    assert rep["cost"]["proxy"]["step_time_mean_s"] == 1.0
    # parameters and peak memory next to the times, as proxy / original ratios; the peak is the
    # whole process's, so the report says that it includes the dump steps
    assert rep["cost"]["ratios"] == {
        "step_time_mean_s": 0.5,
        "train_time_mean_s": 0.5,
        "params": 0.25,
        "peak_rss_mib": 0.25,
    }
    assert "dump steps included (original: 9; proxy: 9" in rep["cost"]["note"]
    md = (tmp_path / "out" / "fidelity.md").read_text()
    assert "| peak_rss_mib | 800 | 200 | 0.25 |" in md and "| params | 1000 | 250 | 0.25 |" in md
