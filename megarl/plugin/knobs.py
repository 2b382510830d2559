"""Typed knobs of parts and methods: a dataclass per part, filled from a config mapping."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any


class Knobs:
    """Base of knob dataclasses; ``check`` raises ``ValueError`` on out-of-range values."""

    def check(self) -> None:
        """Range checks across fields (none by default)."""


def build_knobs(cls: type | None, raw: dict, where: str) -> Any:
    """``cls(**raw)`` with every key and value checked; errors name ``where.<key>`` and what is allowed.
    ``cls=None`` accepts no knobs."""
    raw = dict(raw or {})
    if cls is None:
        if raw:
            raise ValueError(f"unknown key {where}.{sorted(raw)[0]}: this part takes no knobs")
        return None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for k, v in raw.items():
        if k not in fields:
            raise ValueError(f"unknown key {where}.{k}; allowed: {', '.join(fields) or 'none'}")
        tp = hints[k]
        if tp is bool and not isinstance(v, bool):
            raise ValueError(f"{where}.{k}={v!r} must be true or false")
        if tp in (int, float) and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"{where}.{k}={v!r} must be a number")
        if tp is int and not isinstance(v, int):
            raise ValueError(f"{where}.{k}={v!r} must be an integer")
        if tp is str and not isinstance(v, str):
            raise ValueError(f"{where}.{k}={v!r} must be a string")
    out = cls(**{k: (float(v) if hints[k] is float else v) for k, v in raw.items()})
    if isinstance(out, Knobs):
        try:
            out.check()
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return out
