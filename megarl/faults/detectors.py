"""Per-step fault detectors over the trainer's metrics record.

Each detector looks at one step's numbers (and, for spikes and entropy, a running baseline) and
returns events: plain dicts ``{"type": str, "step": int, "detail": {...}}`` (``make_event``).
Event types are listed in megarl.faults.config.EVENT_TYPES. ``DetectorSuite`` runs them all and
carries their state (saved in step dumps so a replay is judged against the same baseline).

Metric keys read (the trainer's record, docs/trainer.md): ``train/loss``, ``train/grad_norm``,
``train/entropy``, ``faults/logprob_gap_first`` (the train/rollout logprob gap of the step's first
optimizer step, else ``train/train_rollout_logprob_gap``), ``rollout/logprob_gap_old``, and for the
update drift ``train/train_rollout_logprob_gap`` minus ``faults/logprob_gap_first``; router loads
come separately as ``[n_moe_layers, E]`` token counts (megarl.faults.router_stats).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megarl.faults.config import DetectorConfig


def make_event(type_: str, step: int, **detail: Any) -> dict:
    """One structured event as written into metrics.jsonl (``events`` list of the step record)."""
    return {"type": type_, "step": int(step), "detail": detail}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


class SpikeDetector:
    """EMA mean and variance of one scalar; flags values more than ``z`` baseline stds away.

    ``two_sided``: flag drops too (loss); otherwise only rises (grad norm). A flagged value does
    not update the baseline, so a run of spikes keeps being measured against the healthy steps.
    """

    def __init__(
        self,
        z: float,
        beta: float,
        warmup: int,
        min_rel_std: float,
        two_sided: bool = False,
        min_abs_std: float = 0.0,
    ):
        self.z, self.beta, self.warmup, self.min_rel_std, self.two_sided = (
            z,
            beta,
            warmup,
            min_rel_std,
            two_sided,
        )
        self.min_abs_std = min_abs_std
        self.mean = 0.0
        self.var = 0.0
        self.count = 0

    def update(self, x: float) -> dict | None:
        """Feed one value; returns the spike detail (value, baseline, z) or None."""
        if not _finite(x):
            return None  # the non-finite detector reports these
        hit = None
        if self.count >= self.warmup and self.z > 0:
            std = max(math.sqrt(self.var), self.min_rel_std * abs(self.mean), self.min_abs_std, 1e-12)
            dev = x - self.mean
            z = abs(dev) / std if self.two_sided else dev / std
            if z > self.z:
                hit = {"value": x, "baseline_mean": self.mean, "baseline_std": std, "z": z}
        if hit is None:
            if self.count == 0:
                self.mean, self.var = x, 0.0
            else:
                d = x - self.mean
                self.mean += (1 - self.beta) * d
                self.var = self.beta * (self.var + (1 - self.beta) * d * d)
            self.count += 1
        return hit

    def state_dict(self) -> dict:
        """The baseline (mean, variance, count of values seen)."""
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, st: dict) -> None:
        """Restore a baseline saved by ``state_dict``."""
        self.mean, self.var, self.count = float(st["mean"]), float(st["var"]), int(st["count"])


def router_load_stats(counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per MoE layer load statistics from token-to-expert counts ``counts: [n_layers, E]``.

    Returns ``fractions [n_layers, E]`` (share of routed slots per expert), ``imbalance [n_layers]``
    (max share x E: 1 = perfectly balanced, E / topk = all tokens on topk experts) and
    ``entropy [n_layers]`` (entropy of the shares / log E: 1 = balanced, 0 = one expert).
    """
    c = counts.double()
    total = c.sum(-1, keepdim=True).clamp_min(1.0)
    f = c / total
    E = c.shape[-1]
    ent = -(f * torch.log(f.clamp_min(1e-30))).sum(-1) / math.log(E) if E > 1 else torch.ones(c.shape[0])
    return {"fractions": f, "imbalance": f.max(-1).values * E, "entropy": ent}


def update_drift(rec: dict) -> float | None:
    """How far the step's later optimizer steps moved the policy from the rollout weights: the
    step-mean train/rollout logprob gap minus the first optimizer step's (0 with one optimizer
    step per trainer step); None when the record lacks either."""
    mean, first = rec.get("train/train_rollout_logprob_gap"), rec.get("faults/logprob_gap_first")
    return mean - first if _finite(mean) and _finite(first) else None


class DetectorSuite:
    """All detectors of one run; ``check`` returns the step's events."""

    def __init__(self, cfg: DetectorConfig):
        self.cfg = cfg
        self.loss = SpikeDetector(
            cfg.spike_z,
            cfg.spike_beta,
            cfg.spike_warmup,
            cfg.spike_min_rel_std,
            two_sided=True,
            min_abs_std=cfg.spike_min_abs_std,
        )
        self.grad_norm = SpikeDetector(
            cfg.spike_z,
            cfg.spike_beta,
            cfg.spike_warmup,
            cfg.spike_min_rel_std,
            min_abs_std=cfg.spike_min_abs_std,
        )
        self.drift = SpikeDetector(
            cfg.spike_z,
            cfg.spike_beta,
            cfg.spike_warmup,
            cfg.spike_min_rel_std,
            min_abs_std=cfg.spike_min_abs_std,
        )
        self.entropy_baseline: float | None = None

    def check(
        self,
        step: int,
        rec: dict,
        router_counts: torch.Tensor | None = None,
        moe_layers: tuple[int, ...] = (),
    ) -> list[dict]:
        """Events of trainer step ``step`` from its metrics record ``rec`` and router counts
        ``[n_moe_layers, E]`` (``moe_layers``: their global layer indices, for the event detail)."""
        c = self.cfg
        ev: list[dict] = []
        loss, gn = rec.get("train/loss"), rec.get("train/grad_norm")
        bad = {k: v for k, v in (("loss", loss), ("grad_norm", gn)) if v is not None and not _finite(v)}
        if bad:
            ev.append(
                make_event(
                    "nonfinite",
                    step,
                    **{k: str(v) for k, v in bad.items()},
                    optimizer_step_skipped=rec.get("train/update_successful", 1.0) < 1.0,
                )
            )
        if loss is not None:
            hit = self.loss.update(loss)
            if hit:
                ev.append(make_event("loss_spike", step, **hit))
        if gn is not None:
            hit = self.grad_norm.update(gn)
            if hit:
                ev.append(make_event("grad_norm_spike", step, **hit))
        if c.logprob_gap_max > 0:
            # the train forward's gap of the step's FIRST optimizer step (weights = rollout weights,
            # so only numerics remain); the step mean also holds the policy's drift after updates
            train_key = (
                "faults/logprob_gap_first"
                if "faults/logprob_gap_first" in rec
                else "train/train_rollout_logprob_gap"
            )
            gaps = {k: rec[k] for k in (train_key, "rollout/logprob_gap_old") if _finite(rec.get(k))}
            worst = max(gaps.items(), key=lambda kv: kv[1], default=None)
            if worst is not None and worst[1] > c.logprob_gap_max:
                ev.append(
                    make_event(
                        "logprob_gap", step, metric=worst[0], value=worst[1], threshold=c.logprob_gap_max
                    )
                )
        drift = update_drift(rec)
        if drift is not None:
            hit = self.drift.update(drift)
            if hit:
                ev.append(make_event("update_drift_spike", step, **hit))
        ent = rec.get("train/entropy")
        if _finite(ent):
            if self.entropy_baseline is None:
                self.entropy_baseline = ent
            floor = max(c.entropy_min, c.entropy_drop_frac * self.entropy_baseline)
            if floor > 0 and ent < floor:
                ev.append(
                    make_event(
                        "entropy_collapse", step, value=ent, floor=floor, initial=self.entropy_baseline
                    )
                )
        if router_counts is not None and router_counts.numel() and router_counts.sum() > 0:
            st = router_load_stats(router_counts)
            for i in range(router_counts.shape[0]):
                layer = moe_layers[i] if i < len(moe_layers) else i
                h, imb = float(st["entropy"][i]), float(st["imbalance"][i])
                if c.router_entropy_min > 0 and h < c.router_entropy_min:
                    ev.append(
                        make_event(
                            "router_collapse",
                            step,
                            layer=layer,
                            load_entropy=h,
                            threshold=c.router_entropy_min,
                            experts_used=int((router_counts[i] > 0).sum()),
                        )
                    )
                if c.router_imbalance_max > 0 and imb > c.router_imbalance_max:
                    ev.append(
                        make_event(
                            "load_imbalance",
                            step,
                            layer=layer,
                            imbalance=imb,
                            threshold=c.router_imbalance_max,
                        )
                    )
        return ev

    def state_dict(self) -> dict:
        """Baselines of the stateful detectors."""
        return {
            "loss": self.loss.state_dict(),
            "grad_norm": self.grad_norm.state_dict(),
            "drift": self.drift.state_dict(),
            "entropy_baseline": self.entropy_baseline,
        }

    def load_state_dict(self, st: dict) -> None:
        """Restore baselines saved by ``state_dict``."""
        self.loss.load_state_dict(st["loss"])
        self.grad_norm.load_state_dict(st["grad_norm"])
        if "drift" in st:  # dumps written before this detector existed have no drift baseline
            self.drift.load_state_dict(st["drift"])
        self.entropy_baseline = st["entropy_baseline"]
