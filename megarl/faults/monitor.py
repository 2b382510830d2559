"""The trainer's fault hooks: injections, detectors, non-finite guard and step dumps in one object.

The loop (megarl/trainer/loop.py) calls, on every rank::

    faults = FaultMonitor(cfg.faults, learner, groups, run_dir, hf_config, run_config)   # setup
    local = faults.before_train(step, local, objective, micro, norms)   # before each train_step
    faults.after_train(step, metrics)                                   # after each train_step
    rec.update(faults.end_step(step, rec))                              # once per trainer step

``end_step`` returns what goes into the step's metrics record: ``events`` (a list of
``{type, step, detail}``, only when there are any), cumulative counters ``faults/<type>_total``,
per-MoE-layer router load (``router/layer<L>/imbalance|load_entropy|load``) and
``faults/injected``. Collective calls (weight snapshot, router counts) happen on every rank in the
same order; only rank 0 writes dumps.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.batch import PackedBatch
from megarl.faults.config import FaultsConfig
from megarl.faults.detectors import DetectorSuite, router_load_stats
from megarl.faults.dump import batch_from_dict, batch_to_dict, model_shape, write_dump
from megarl.faults.guard import NonFiniteGuard
from megarl.faults.injection import Injector, describe
from megarl.faults.router_stats import RouterLoadCounter
from megarl.objectives.api import GlobalNormalisers

RECORDED_PREFIXES = ("train/", "rollout/logprob_gap_old", "reward/mean", "adv/")


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def layout_dict(groups) -> dict:
    """The learner layout of ``groups`` as plain data (for dumps)."""
    return dict(dataclasses.asdict(groups.layout), world_size=groups.world_size, dp=groups.dp_size)


class FaultMonitor:
    """Fault tooling of one learner (see the module docstring for the call protocol).

    ``run_config``: the resolved run config as a dict (stored in dumps, so a replay rebuilds the
    optimizer and the objective the same way). ``history``: earlier metric records of a resumed
    run; the detector baselines and counters are rebuilt from them.
    """

    def __init__(
        self,
        cfg: FaultsConfig,
        learner,
        groups,
        run_dir: str | Path,
        hf_config: dict,
        run_config: dict,
        history: list[dict] | None = None,
    ):
        self.cfg, self.learner, self.groups = cfg, learner, groups
        self.run_dir, self.hf_config, self.run_config = Path(run_dir), dict(hf_config), run_config
        spec = learner.spec
        self.spec = spec
        self.suite = DetectorSuite(cfg.detectors) if cfg.detect else None
        self.guard = (
            NonFiniteGuard(learner).install() if cfg.detect and cfg.detectors.skip_nonfinite else None
        )
        self.injector = Injector(
            learner.model,
            cfg.inject,
            device_type=groups.device.type,
            vocab_size=spec.vocab_size,
            optimizer=learner.optimizer,
        )
        self.router = (
            RouterLoadCounter(learner.model, spec.moe_layers, spec.num_experts)
            if cfg.detect and spec.is_moe
            else None
        )
        self.dump_dir = Path(cfg.dump_dir) if cfg.dump_dir else self.run_dir / "dumps"
        self.totals: dict[str, int] = {}
        self._reset_step(None)
        for rec in history or []:
            self._replay_history(rec)

    # ------------------------------------------------------------------------------ state
    def _reset_step(self, step: int | None) -> None:
        self.step = step
        self.batches: list[dict] = []
        self.opt_metrics: list[dict] = []
        self.snapshot: dict | None = None
        self.injected: list = []

    def _replay_history(self, rec: dict) -> None:
        """Feed one earlier record to the baselines and counters (resume)."""
        if self.suite is not None and rec.get("step", 0) > 0:
            self.suite.check(
                int(rec["step"]),
                {k: (float("nan") if v is None and k.startswith("train/") else v) for k, v in rec.items()},
            )
        for k, v in rec.items():
            if k.startswith("faults/") and k.endswith("_total") and isinstance(v, int):
                self.totals[k[7:-6]] = v

    def _wants_snapshot(self, step: int) -> bool:
        return step in self.cfg.dump_steps or (bool(self.cfg.dump_on) and self.cfg.max_dumps > 0)

    def _take_snapshot(self, step: int, objective) -> dict:
        """Pre-step state: HF weights (collective), objective state, learner step, RNG."""
        from megarl.learner.factory import export_state

        weights = {k: v.detach().cpu().clone() for k, v in export_state(self.learner).items()}
        learner_dir = None
        if step in self.cfg.dump_steps and self.cfg.dump_learner_state and _optimizer_has_state(self.learner):
            # known in advance: the full learner state (weights, Adam moments, LR schedule, RNG)
            # before the step, so every optimizer step of it replays exactly (collective). Before
            # the first successful update the optimizer is fresh, as a replay's is: nothing to save.
            from megarl.learner.dist_checkpoint import save_checkpoint

            learner_dir = self.dump_dir / f".learner_before_{step:06d}"
            if _rank0() and learner_dir.exists():
                shutil.rmtree(learner_dir)
            if dist.is_initialized():
                dist.barrier()
            save_checkpoint(self.learner, learner_dir)
        obj_state = copy.deepcopy(objective.state_dict()) if hasattr(objective, "state_dict") else {}
        return {
            "weights": weights,
            "learner_dir": learner_dir,
            "objective_state": obj_state,
            "learner_step": int(self.learner.step),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "detectors": copy.deepcopy(self.suite.state_dict()) if self.suite else None,
        }

    # ------------------------------------------------------------------------------ hooks
    def before_train(
        self, step: int, batch: PackedBatch, objective, num_micro_batches: int, normalisers: GlobalNormalisers
    ) -> PackedBatch:
        """Before one ``learner.train_step`` of trainer step ``step``: snapshot (first call of a step
        that may be dumped), poison the batch, arm the step's injections, count router load."""
        if self.step != step:
            self._reset_step(step)
            if self._wants_snapshot(step):
                self.snapshot = self._take_snapshot(step, objective)
            if self.router is not None:
                self.router.start()
        clean = batch
        batch, poisoned = self.injector.poison(batch, step)
        armed = self.injector.arm(step)
        for s in poisoned + armed:
            if s not in self.injected:
                self.injected.append(s)
        rec = {"batch": batch, "num_micro_batches": num_micro_batches, "normalisers": normalisers}
        if poisoned:
            # the batch before the poison: a replay on a proxy recomputes old logprobs on it and
            # poisons it again (recomputing them on the poisoned tokens would erase the fault)
            rec["clean_batch"] = clean
        if self._wants_snapshot(step) and self.groups.dp_size > 1:
            # every DP rank's share, so a dump holds the whole optimizer step (collective over DP)
            rec["dp_shares"] = self._gather_shares(batch)
            if poisoned:
                rec["clean_dp_shares"] = self._gather_shares(clean)
        self.batches.append(rec)
        return batch

    def _gather_shares(self, batch: PackedBatch) -> list[PackedBatch]:
        """Every DP rank's ``batch``, in DP-rank order (collective over the DP group)."""
        shares: list = [None] * self.groups.dp_size
        dist.all_gather_object(shares, batch_to_dict(batch), group=self.groups.dp)
        return [batch_from_dict(x) for x in shares]

    def after_train(self, step: int, metrics: dict) -> None:
        """After one ``learner.train_step``: remove the injection hooks, keep its metrics."""
        self.injector.disarm()
        self.opt_metrics.append(dict(metrics))

    def end_step(self, step: int, rec: dict) -> dict:
        """Detectors over the step's record; returns the fields to add to it (events, counters,
        router load). Dumps the step when asked or when an event of ``dump_on`` fired."""
        out: dict[str, Any] = {}
        counts = None
        if self.router is not None and self.step == step:
            self.router.stop()
            world = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
            counts = self.router.collect(world, self.groups.device)
            st = router_load_stats(counts)
            for i, layer in enumerate(self.spec.moe_layers):
                out[f"router/layer{layer}/imbalance"] = float(st["imbalance"][i])
                out[f"router/layer{layer}/load_entropy"] = float(st["entropy"][i])
                out[f"router/layer{layer}/load"] = [round(float(x), 6) for x in st["fractions"][i]]
        first_gap = self.opt_metrics[0].get("train_rollout_logprob_gap") if self.opt_metrics else None
        if first_gap is not None:
            out["faults/logprob_gap_first"] = first_gap
        events: list[dict] = []
        if self.suite is not None:
            events = self.suite.check(step, {**rec, **out}, counts, self.spec.moe_layers)
        if self.injected:
            out["faults/injected"] = [s.kind for s in self.injected]
        for e in events:
            self.totals[e["type"]] = self.totals.get(e["type"], 0) + 1
        if events:
            out["events"] = events
            if _rank0():
                print(
                    f"megarl train: step {step} fault events: " + ", ".join(_short(e) for e in events),
                    flush=True,
                )
        for k, v in self.totals.items():
            out[f"faults/{k}_total"] = v
        if self.guard is not None:
            out["faults/skipped_optimizer_steps"] = sum(
                1 for m in self.opt_metrics if m.get("update_successful", 1.0) < 1.0
            )
        why = [e["type"] for e in events if e["type"] in self.cfg.dump_on]
        if step in self.cfg.dump_steps:
            why.append("dump_steps")
        if why and self.snapshot is not None and self.step == step and self._dumps_left() > 0:
            path = self._dump(step, rec, out, events, why)
            if path is not None:
                out["faults/dump"] = str(path)
        self._reset_step(None)
        return out

    # ------------------------------------------------------------------------------ dumps
    def _dumps_left(self) -> int:
        done = len(list(self.dump_dir.glob("step_*[0-9]"))) if self.dump_dir.is_dir() else 0
        return self.cfg.max_dumps + len(self.cfg.dump_steps) - done

    def _dump(self, step: int, rec: dict, out: dict, events: list[dict], why: list[str]) -> Path | None:
        if not _rank0():
            return None
        t0 = time.time()
        snap = self.snapshot
        prev = self.run_dir / "checkpoints" / f"step_{step - 1:06d}"
        recorded = {
            k: v
            for k, v in {**rec, **out}.items()
            if any(k.startswith(p) for p in RECORDED_PREFIXES) or k.startswith("router/")
        }
        meta = {
            "format": "megarl-step-dump/1",
            "step": step,
            "why": why,
            "events": events,
            "model": model_shape(self.hf_config),
            "layout": layout_dict(self.groups),
            "run_config": self.run_config,
            "injections": describe(self.injected),
            "optimizer_steps": [
                {k: m.get(k) for k in ("loss", "grad_norm", "update_successful", "lr")}
                for m in self.opt_metrics
            ],
            "recorded": recorded,
            "torch_threads": torch.get_num_threads(),
            "checkpoint_before": str(prev) if prev.is_dir() else None,
            "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        state = {
            "objective_state": snap["objective_state"],
            "learner_step": snap["learner_step"],
            "rng": snap["rng"],
            "detectors": snap["detectors"],
        }
        path = write_dump(
            self.dump_dir / f"step_{step:06d}",
            _json_safe(meta),
            self.batches,
            state,
            snap["weights"],
            self.hf_config,
            learner_dir=snap["learner_dir"],
            side_files_from=((self.run_config or {}).get("model") or {}).get("hf_dir"),
        )
        print(
            f"megarl train: step {step} dumped to {path} ({', '.join(why)}; {time.time() - t0:.1f}s)",
            flush=True,
        )
        return path

    def close(self) -> None:
        """Remove hooks and the optimizer guard."""
        self.injector.disarm()
        if self.router is not None:
            self.router.stop()
        if self.guard is not None:
            self.guard.uninstall()


def _optimizer_has_state(learner) -> bool:
    """Whether Adam holds moments yet (megatron cannot save a never-stepped optimizer)."""
    opts = getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
    return any(len(getattr(o, "optimizer", o).state) > 0 for o in opts)


def _short(e: dict) -> str:
    """``type(key=value, ...)`` of an event, for the log line."""
    d = ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in e["detail"].items()
        if k not in ("load",)
    )
    return f"{e['type']}({d})"


def _json_safe(x: Any) -> Any:
    """Non-finite floats as strings, recursively (dump.json stays strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x
