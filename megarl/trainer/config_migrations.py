"""Config keys that older configs wrote and megarl no longer reads there: a config that still has one
gets a message naming where each of its keys went, not a bare "unknown key".

Where a key went is declared by the part that reads it now: an input provider's ``moved_from``
(megarl/plugin/inputs.py) maps old dotted keys to its knobs, written as ``inputs.<name>.<knob>``.
A top-level section all of whose keys moved is a removed section.
"""

from __future__ import annotations

from typing import Any

from megarl.trainer.config_sections import ConfigError, TrainConfig, yaml_fields


def moved_keys() -> dict[str, str]:
    """{old dotted key: new dotted key} declared by the registered input providers."""
    from megarl.catalogue import load_builtin
    from megarl.plugin.inputs import INPUT_PROVIDERS

    load_builtin()
    out: dict[str, str] = {}
    for name, p in INPUT_PROVIDERS.items():
        if name == p.provides[0]:  # once per provider, under its first input name
            out.update({old: f"inputs.{name}.{knob}" for old, knob in p.moved_from})
    return out


def _leaves(value: Any, prefix: str) -> list[str]:
    """Dotted keys of every leaf under ``value`` (a nested mapping); an empty mapping is a leaf."""
    if not isinstance(value, dict) or not value:
        return [prefix]
    return [k for name, v in value.items() for k in _leaves(v, f"{prefix}.{name}")]


def check_removed_sections(data: dict) -> None:
    """Raise ``ConfigError`` naming the new key of every key of a removed section in ``data``."""
    from megarl.plugin.config_parts import SECTIONS

    current = {f.name for f in yaml_fields(TrainConfig)} | set(SECTIONS)
    if not set(data) - current:
        return
    moved = moved_keys()
    for section in sorted({old.split(".")[0] for old in moved} - current):
        if section not in data:
            continue
        moves = {old: new for old, new in moved.items() if old.startswith(section + ".")}
        # a (sub-)section written as a leaf (null or an empty mapping) stands for all its keys
        given = [
            k
            for leaf in _leaves(data[section], section)
            for k in ([m for m in moves if m.startswith(leaf + ".")] or [leaf])
        ]
        strays = [k for k in given if k not in moves]
        listed = [k for k in given if k in moves] if given and not strays else list(moves)
        msg = f"the {section} section was removed; its keys moved: " + ", ".join(
            f"{k} -> {moves[k]}" for k in listed
        )
        if strays:
            msg += f". {', '.join(strays)} is no key of the removed {section} section"
        raise ConfigError(msg + " (docs/configuration.md, section inputs)")
