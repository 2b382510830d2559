"""Config sections and keys that packages contribute to the ``megarl train`` config.

A package that owns a concept declares its settings here, at import, as a dataclass whose fields
carry their meaning as ``#`` comments (the configuration reference reads them):

- ``register_section(name, schema, check=, ranges=)``: a whole top-level section (``name:`` in the
  YAML), built into ``schema`` and reached from code through ``section_of(cfg, name, schema)``;
- ``register_keys(section, choice, schema, check=, ranges=)``: keys of an existing section that
  exist only when the section's selector (``environment.name``) is ``choice``; written beside the
  section's own keys in the YAML and reached through ``chosen_keys(section_value, schema)``.

``check(cfg)`` runs with the config's other checks and raises ``ValueError`` naming the dotted key;
``ranges`` maps a key of ``schema`` to its ``Range`` (checked right after loading, before torch).
The modules that register are imported before a config is built (``megarl.catalogue.CONFIG_MODULES``).
This module imports nothing of megarl, so any layer may contribute.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


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


@dataclass(frozen=True)
class ConfigPart:
    """One contribution: ``schema`` (a dataclass), ``check(cfg)`` (None: no check beyond types and
    ranges), ``ranges`` (key of ``schema`` -> ``Range``) and ``owner`` (the registering module)."""

    schema: type
    check: Callable[[Any], None] | None = None
    ranges: Mapping[str, Range] = field(default_factory=dict)
    owner: str = ""


SECTIONS: dict[str, ConfigPart] = {}  # top-level section name -> its part
KEYS: dict[str, dict[str, ConfigPart]] = {}  # section name -> selector value -> the keys it adds


def _part(
    schema: type, check: Callable[[Any], None] | None, ranges: Mapping[str, Range] | None
) -> ConfigPart:
    if not dataclasses.is_dataclass(schema):
        raise TypeError(f"a contributed config schema must be a dataclass, got {schema!r}")
    names = {f.name for f in dataclasses.fields(schema)}
    stray = sorted(set(ranges or {}) - names)
    if stray:
        raise ValueError(f"ranges name {stray[0]!r}, which is no field of {schema.__name__}")
    return ConfigPart(schema, check, dict(ranges or {}), schema.__module__)


def register_section(
    name: str,
    schema: type,
    check: Callable[[Any], None] | None = None,
    ranges: Mapping[str, Range] | None = None,
) -> None:
    """Contribute the top-level section ``name`` (its keys: the fields of ``schema``); a second
    registration of the same schema is a no-op, of another one an error."""
    part = _part(schema, check, ranges)
    old = SECTIONS.get(name)
    if old is not None and old.schema is not schema:
        raise ValueError(f"config section {name!r} is already contributed by {old.owner}")
    SECTIONS[name] = part


def register_keys(
    section: str,
    choice: str,
    schema: type,
    check: Callable[[Any], None] | None = None,
    ranges: Mapping[str, Range] | None = None,
) -> None:
    """Contribute the keys of ``schema`` to ``section`` when its selector is ``choice`` (e.g. a
    workflow's own ``environment.*`` keys under ``environment.name: <choice>``)."""
    part = _part(schema, check, ranges)
    old = KEYS.setdefault(section, {}).get(choice)
    if old is not None and old.schema is not schema:
        raise ValueError(f"{section} keys of {choice!r} are already contributed by {old.owner}")
    KEYS[section][choice] = part


def section_of(cfg: Any, name: str, schema: type[T]) -> T:
    """The contributed section ``name`` of a loaded config (``cfg.sections``), typed as ``schema``;
    a config built without it (e.g. ``TrainConfig()`` in code) gets the defaults, kept in the config
    so later changes stick."""
    sections = cfg.sections
    value = sections.get(name)
    if value is None:
        value = sections[name] = schema()
    if not isinstance(value, schema):
        raise TypeError(f"config section {name!r} is a {type(value).__name__}, not a {schema.__name__}")
    return value


def chosen_keys(section: Any, schema: type[T]) -> T:
    """The keys a choice contributed to ``section`` (its ``chosen`` value), typed as ``schema``;
    the defaults of ``schema`` when the section holds none (e.g. built in code)."""
    value = getattr(section, "chosen", None)
    if value is None:
        return schema()
    if not isinstance(value, schema):
        raise TypeError(f"the section holds {type(value).__name__} keys, not {schema.__name__}")
    return value
