"""Sections and keys that older configs used and megarl no longer reads: a config that still has
one gets a message naming where each of its keys went, not a bare "unknown key".

``credit`` (removed when credit methods became plugins): DASH's answer pattern moved to the
``answer_checkpoints`` input provider, RRPO's anchors and head to the ``rrpo_scores`` provider.
"""

from __future__ import annotations

from typing import Any

from megarl.trainer.config_sections import ConfigError

_RRPO_KEYS = (
    "anchors",
    "positive_prompt",
    "negative_prompt",
    "head_dim",
    "head_hidden",
    "head_steps",
    "lr",
    "tau",
)

# removed section -> {old dotted key: new dotted key}
MOVED: dict[str, dict[str, str]] = {
    "credit": {
        "credit.answer_pattern": "inputs.answer_checkpoints.pattern",
        **{f"credit.rrpo.{k}": f"inputs.rrpo_scores.{k}" for k in _RRPO_KEYS},
    }
}


def _leaves(value: Any, prefix: str) -> list[str]:
    """Dotted keys of every leaf under ``value`` (a nested mapping), e.g. ``credit.rrpo.tau``."""
    if not isinstance(value, dict) or not value:
        return [prefix] if prefix.count(".") else []
    return [k for name, v in value.items() for k in _leaves(v, f"{prefix}.{name}")]


def check_removed_sections(data: dict) -> None:
    """Raise ``ConfigError`` naming the new key of every key of a removed section in ``data``."""
    for section, moves in MOVED.items():
        if section not in data:
            continue
        given = _leaves(data[section], section)
        # a whole sub-section written as a leaf (credit.rrpo: null) moves like its keys
        given = [k for g in given for k in ([m for m in moves if m.startswith(g + ".")] or [g])]
        known = [k for k in given if k in moves]
        strays = [k for k in given if k not in moves]
        listed = known if known and not strays else list(moves)
        msg = f"the {section} section was removed; its keys moved: " + ", ".join(
            f"{k} -> {moves[k]}" for k in listed
        )
        if strays:
            msg += f". {', '.join(strays)} is no key of the removed {section} section"
        raise ConfigError(msg + " (docs/configuration.md, section inputs)")
