"""The allowed range of every numeric config key with one (``RANGES``), checked by ``check_ranges``
right after loading and before any part registry (and torch) is imported.

A value outside its range would crash the run later or quietly switch something off (a negative
``optimizer.clip_grad`` disables clipping, a negative ``schedule.eval_samples`` evaluates all rows
but that many); the message names the key and the range. NaN and infinity are refused in every
ranged float and in every reward weight. The sections and keys other packages contribute bring
their own ranges (megarl/plugin/config_parts.py), checked here too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megarl.plugin.config_parts import FINITE, KEYS, NON_NEGATIVE, POSITIVE, SECTIONS, ConfigPart, Range
from megarl.trainer.config_sections import CHOSEN_BY, ConfigError, TrainConfig, yaml_fields

__all__ = ["FINITE", "NON_NEGATIVE", "POSITIVE", "RANGES", "Range", "all_ranges", "check_ranges"]


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
    "schedule.eval_samples": Range(lo=0, lo_open=True, note="an empty data.eval switches evaluation off"),
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


def contributed_parts(cfg: TrainConfig) -> list[tuple[str, ConfigPart, Any]]:
    """(section name, part, its value) of every contributed section and of every section's chosen
    keys (megarl/plugin/config_parts.py) in ``cfg``."""
    out = [(name, part, cfg.sections.get(name)) for name, part in SECTIONS.items()]
    for f in yaml_fields(TrainConfig):
        section = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(section):
            continue
        for g in dataclasses.fields(section):
            selector = g.metadata.get(CHOSEN_BY)
            part = KEYS.get(f.name, {}).get(getattr(section, selector)) if selector else None
            if part is not None:
                out.append((f.name, part, getattr(section, g.name)))
    return [(name, part, value) for name, part, value in out if value is not None]


def all_ranges() -> dict[str, Range]:
    """``RANGES`` and the ranges of every contributed section and key (``section.key`` -> range)."""
    out = dict(RANGES)
    for name, part in SECTIONS.items():
        out.update({f"{name}.{k}": r for k, r in part.ranges.items()})
    for name, choices in KEYS.items():
        for part in choices.values():
            out.update({f"{name}.{k}": r for k, r in part.ranges.items()})
    return out


def _check(name: str, v: Any, rng: Range) -> None:
    if v is None and rng.none_ok:
        return
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or not rng.holds(v):
        note = f" ({rng.note})" if rng.note else ""
        raise ConfigError(f"{name}={v!r} must be {rng.text()}{note}")


def check_ranges(cfg: TrainConfig) -> None:
    """Raise ``ConfigError`` naming the first key outside its range (``RANGES`` and the contributed
    ranges) and the range."""
    for key, rng in RANGES.items():
        for name, v in _values(cfg, key):
            _check(name, v, rng)
    for prefix, part, value in contributed_parts(cfg):
        for key, rng in part.ranges.items():
            _check(f"{prefix}.{key}", getattr(value, key), rng)
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
    rng = all_ranges().get(key)
    if rng is None:
        return ""
    return rng.text() + (" or null" if rng.none_ok else "")
