"""The allowed range of every numeric config key with one (``RANGES``), checked by ``check_ranges``
right after loading and before any part registry (and torch) is imported.

A value outside its range would crash the run later or quietly switch something off (a negative
``optimizer.clip_grad`` disables clipping, a negative ``schedule.eval_samples`` evaluates all rows
but that many); the message names the key and the range. NaN and infinity are refused in every
ranged float and in every reward weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megarl.trainer.config_sections import ConfigError, TrainConfig


@dataclass(frozen=True)
class Range:
    """``lo``/``hi`` bounds (None = unbounded), open or closed; ``note`` says what a special value
    means (e.g. "0 = off"); ``none_ok``: null is allowed too."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""
    none_ok: bool = False

    def text(self) -> str:
        """The range as the error message and the docs write it: "> 0", "in [0, 1)", ...."""
        if self.lo is not None and self.hi is not None:
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            return f"in {left}{_num(self.lo)}, {_num(self.hi)}{right}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        return "a finite number"

    def holds(self, v: float) -> bool:
        """Whether ``v`` (a number) is finite and inside the range."""
        if not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


POSITIVE = Range(lo=0, lo_open=True)
NON_NEGATIVE = Range(lo=0)
FINITE = Range()

# dotted key -> its range; ``reward.functions[].weight`` applies to every item of the list
RANGES: dict[str, Range] = {
    "parallel.tp": POSITIVE,
    "parallel.pp": POSITIVE,
    "parallel.ep": POSITIVE,
    "parallel.cp": POSITIVE,
    "parallel.expert_tp": Range(lo=0, lo_open=True, none_ok=True, note="null = megatron's default"),
    "parallel.world_size": Range(lo=0, note="0 = whatever torchrun started"),
    "rollout.n": POSITIVE,
    "rollout.temperature": Range(lo=0, note="0 = greedy"),
    "rollout.top_p": Range(lo=0, hi=1, lo_open=True, note="1 = off"),
    "rollout.max_new_tokens": POSITIVE,
    "rollout.max_concurrency": POSITIVE,
    "rollout.embedded_batch_rows": POSITIVE,
    "teacher.max_concurrency": POSITIVE,
    "rollout.server_max_num_seqs": POSITIVE,
    "rollout.server_startup_timeout_s": POSITIVE,
    "data.max_bad_rows": NON_NEGATIVE,
    "reward.functions[].weight": FINITE,
    "reward.timeout_s": POSITIVE,
    "reward.fallback": FINITE,
    "reward.judge.timeout_s": POSITIVE,
    "reward.judge.max_new_tokens": POSITIVE,
    "reward.judge.temperature": Range(lo=0, note="0 = greedy"),
    "objective.clip_low": Range(lo=0, lo_open=True, none_ok=True, note="null = the policy loss's own"),
    "objective.clip_high": Range(lo=0, lo_open=True, none_ok=True, note="null = the policy loss's own"),
    "objective.kl_coef": Range(lo=0, note="0 = no KL penalty"),
    "objective.entropy_coef": FINITE,
    "objective.correction_low": NON_NEGATIVE,
    "objective.correction_high": POSITIVE,
    "objective.distill_coef": NON_NEGATIVE,
    "environment.max_turns": POSITIVE,
    "sampling.max_rounds": POSITIVE,
    "optimizer.lr": POSITIVE,
    "optimizer.min_lr": NON_NEGATIVE,
    "optimizer.weight_decay": NON_NEGATIVE,
    "optimizer.adam_beta1": Range(lo=0, hi=1, hi_open=True),
    "optimizer.adam_beta2": Range(lo=0, hi=1, hi_open=True),
    "optimizer.adam_eps": POSITIVE,
    "optimizer.clip_grad": Range(lo=0, note="0 = no clipping"),
    "optimizer.lr_warmup_steps": NON_NEGATIVE,
    "optimizer.lr_decay_steps": Range(lo=0, note="0 = constant after warm-up"),
    "warmup.sft_steps": Range(lo=0, note="0 = no warm-up"),
    "warmup.batch_size": POSITIVE,
    "warmup.lr": POSITIVE,
    "schedule.steps": POSITIVE,
    "schedule.prompts_per_step": POSITIVE,
    "schedule.ppo_epochs": POSITIVE,
    "schedule.mini_batches": POSITIVE,
    "schedule.micro_batches": POSITIVE,
    "schedule.eval_every": Range(lo=0, note="0 = only before and after training"),
    "schedule.eval_samples": Range(lo=0, lo_open=True, note="an empty data.eval turns evaluation off"),
    "schedule.eval_k": POSITIVE,
    "checkpoint.every": POSITIVE,
    "checkpoint.keep_last": POSITIVE,
    "logging.print_every": POSITIVE,
    "async_loop.max_staleness": NON_NEGATIVE,
}


def _values(cfg: TrainConfig, key: str) -> list[tuple[str, Any]]:
    """(dotted key as the user writes it, value) for ``key``; one per list item for ``a.b[].c``."""
    if "[]." in key:
        head, leaf = key.split("[].")
        items = _values(cfg, head)[0][1]
        return [(f"{head}[{i}].{leaf}", getattr(it, leaf)) for i, it in enumerate(items)]
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return [(key, node)]


def check_ranges(cfg: TrainConfig) -> None:
    """Raise ``ConfigError`` naming the first key outside its range (``RANGES``) and the range."""
    for key, rng in RANGES.items():
        for name, v in _values(cfg, key):
            if v is None and rng.none_ok:
                continue
            if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or not rng.holds(v):
                note = f" ({rng.note})" if rng.note else ""
                raise ConfigError(f"{name}={v!r} must be {rng.text()}{note}")
    _check_pairs(cfg)


def _check_pairs(cfg: TrainConfig) -> None:
    """Bounds between two keys and the keys whose range is not an interval."""
    o, r = cfg.optimizer, cfg.rollout
    if o.min_lr > o.lr:
        raise ConfigError(f"optimizer.min_lr={o.min_lr} must be <= optimizer.lr={o.lr}")
    ob = cfg.objective
    if ob.correction_low > ob.correction_high:
        raise ConfigError(
            f"objective.correction_low={ob.correction_low} must be <= objective.correction_high="
            f"{ob.correction_high}"
        )
    if r.top_k != -1 and r.top_k < 1:
        raise ConfigError(f"rollout.top_k={r.top_k} must be -1 (off) or >= 1")


def range_text(key: str) -> str:
    """The documented range of ``key`` ("" when it has none), for docs/configuration.md."""
    if key == "rollout.top_k":
        return "-1 (off) or >= 1"
    rng = RANGES.get(key)
    if rng is None:
        return ""
    return rng.text() + (" or null" if rng.none_ok else "")
