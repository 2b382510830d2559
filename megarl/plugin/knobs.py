"""Knobs of parts and methods, checked key by key against what the part accepts.

Two ways a part states its knobs: a dataclass (``build_knobs``: input providers, method specs) or
the keyword parameters of its callable (``check_call_knobs``: advantage estimators, reward
shapers). Both refuse an unknown key naming it and the allowed ones, and a value of the wrong
kind naming the key.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Callable, Iterable
from typing import Any

# a decimal number as YAML 1.1 leaves it a string (1e-4, no dot) or as typed on the command line
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def as_float_if_number(v: Any, kind: type) -> Any:
    """``v`` as a float when ``kind`` is float and ``v`` is a string that spells a number (``"1e-4"``);
    else ``v`` unchanged."""
    if kind is float and isinstance(v, str) and _NUMBER.fullmatch(v.strip()):
        return float(v)
    return v


def check_value(key: str, v: Any, kind: type, strict_int: bool = False) -> None:
    """Refuse ``v`` when it is not of ``kind`` (bool, a number, an integer with ``strict_int``, a
    string); other kinds are not checked. The message names ``key``."""
    if kind is bool and not isinstance(v, bool):
        raise ValueError(f"{key}={v!r} must be true or false")
    if kind in (int, float) and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise ValueError(f"{key}={v!r} must be a number")
    if kind is int and strict_int and not isinstance(v, int):
        raise ValueError(f"{key}={v!r} must be an integer")
    if kind is str and not isinstance(v, str):
        raise ValueError(f"{key}={v!r} must be a string")


def check_call_knobs(
    fn: Callable,
    knobs: dict,
    where: str,
    owner: str,
    skip: Iterable[str] = (),
    also_allowed: Iterable[str] = (),
) -> None:
    """``knobs`` as keyword arguments of ``fn``: every key a parameter (other than ``skip``), every
    value of its default's kind (bool or number; a string spelling a number is turned into a float
    in ``knobs`` where the default is a float). Errors name ``where.<key>`` and ``owner``."""
    params = {n: p for n, p in inspect.signature(fn).parameters.items() if n not in set(skip)}
    for k, v in knobs.items():
        if k not in params:
            allowed = [*also_allowed, *params]
            raise ValueError(f"unknown key {where}.{k} for {owner}; allowed: {', '.join(allowed)}")
        d = params[k].default
        if isinstance(d, (bool, int, float)):  # only defaults that say a kind are checked
            knobs[k] = v = as_float_if_number(v, type(d))
            check_value(f"{where}.{k}", v, type(d))


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
        raw[k] = v = as_float_if_number(v, hints[k])
        check_value(f"{where}.{k}", v, hints[k], strict_int=True)
    out = cls(**{k: (float(v) if hints[k] is float else v) for k, v in raw.items()})
    if isinstance(out, Knobs):
        try:
            out.check()
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return out
