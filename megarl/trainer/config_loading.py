"""Loading the ``megarl train`` config: YAML plus ``section.key=value`` overrides into the section
dataclasses, every key checked against the fields and every value against the field's type
(``Literal`` fields list their allowed values); ``save_resolved`` writes the resolved config.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megarl.plugin.knobs import as_float_if_number
from megarl.trainer.config_checks import validate
from megarl.trainer.config_migrations import check_removed_sections
from megarl.trainer.config_sections import (
    CHOSEN_BY,
    CONTRIBUTED,
    LIST_ITEM_TYPES,
    ConfigError,
    TrainConfig,
    yaml_fields,
)


def type_name(tp: Any) -> str:
    """How a field's annotation reads in messages and docs ("int", "str or null", "one of 'a', 'b'")."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r}; allowed: {', '.join(repr(a) for a in allowed)}")
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for alt in typing.get_args(tp):
            if alt is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, alt, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}={value!r} must be {type_name(tp)}")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if tp is float:
        value = as_float_if_number(value, float)  # YAML 1.1 reads 1e-4 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string")
        return value
    if tp in (dict,) or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping")
        return dict(value)
    if tp in (list,) or origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a list")
        return list(value)
    raise ConfigError(f"{key}: unsupported type {tp}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    """A dataclass ``cls`` from a mapping, every key and value checked; the sections and keys other
    packages contribute (megarl/plugin/config_parts.py) are built into their owners' dataclasses."""
    from megarl.plugin.config_parts import KEYS, SECTIONS

    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in yaml_fields(cls)]
    holders = [f for f in dataclasses.fields(cls) if f.metadata.get(CONTRIBUTED) or f.metadata.get(CHOSEN_BY)]
    contributed: dict[str, type] = {}  # key -> the contributed dataclass it builds (sections)
    chosen = None  # (holder field name, the part of the selector's choice)
    selector = ""
    for f in holders:
        if f.metadata.get(CONTRIBUTED):
            contributed = {name: SECTIONS[name].schema for name in sorted(SECTIONS)}
        if f.metadata.get(CHOSEN_BY):
            selector = f.metadata[CHOSEN_BY]
            choice = data.get(selector, _field_default(cls, selector))
            chosen = (f.name, KEYS.get(prefix, {}).get(choice))
    own_keys = [f.name for f in dataclasses.fields(chosen[1].schema)] if chosen and chosen[1] else []
    allowed = names + list(contributed) + own_keys
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown key {where}{unknown[0]}; allowed in {prefix or 'the top level'}: "
            f"{', '.join(allowed)}{_chosen_hint(prefix, selector, unknown[0])}"
        )
    kw = {}
    for name in names:
        if name not in data:
            continue
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        v = data[name]
        if dataclasses.is_dataclass(tp):
            kw[name] = _build(tp, v, key)
        elif (prefix, name) in LIST_ITEM_TYPES:
            items = _coerce(v, list, key)
            kw[name] = [
                _build(LIST_ITEM_TYPES[(prefix, name)], it, f"{key}[{i}]") for i, it in enumerate(items)
            ]
        else:
            kw[name] = _coerce(v, tp, key)
    for f in holders:
        if f.metadata.get(CONTRIBUTED):
            kw[f.name] = {n: _build(schema, data.get(n), n) for n, schema in contributed.items()}
    if chosen and chosen[1]:
        kw[chosen[0]] = _build(chosen[1].schema, {k: data[k] for k in own_keys if k in data}, prefix)
    return cls(**kw)


def _field_default(cls: type, name: str) -> Any:
    """The default of ``cls``'s field ``name``."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _chosen_hint(prefix: str, selector: str, key: str) -> str:
    """For a key that another choice of the section's ``selector`` contributes: which ones take it."""
    from megarl.plugin.config_parts import KEYS

    takers = [
        c
        for c, part in KEYS.get(prefix, {}).items()
        if key in {f.name for f in dataclasses.fields(part.schema)}
    ]
    if not selector or not takers:
        return ""
    return f" ({prefix}.{key} needs {prefix}.{selector}: {' or '.join(takers)})"


def _advantage_from_yaml(d: Any) -> dict:
    """The core example files write estimator knobs next to ``estimator``; fold them into ``knobs``."""
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"advantage must be a mapping, got {type(d).__name__}")
    d = dict(d)
    knobs = dict(d.pop("knobs", None) or {})
    est = d.pop("estimator", "grpo")
    knobs.update(d)
    return {"estimator": est, "knobs": knobs}


def from_dict(data: dict) -> TrainConfig:
    """A validated ``TrainConfig`` from a plain dict (the parsed YAML)."""
    if not isinstance(data, dict):
        raise ConfigError(f"the config must be a mapping of sections, got {type(data).__name__}")
    from megarl.catalogue import load_config_parts

    load_config_parts()
    data = dict(data)
    check_removed_sections(data)
    if data.get("method") is not None:
        data = _with_method_defaults(data)
    if "advantage" in data:
        data["advantage"] = _advantage_from_yaml(data["advantage"])
    cfg = _build(TrainConfig, data, "")
    validate(cfg)
    return cfg


def _with_method_defaults(data: dict) -> dict:
    """The method's config sections under the user's: a key the user sets wins, a key left unset
    takes the method's own default (``MethodSpec.config``)."""
    from megarl.catalogue import method_spec

    section = data["method"]
    if not isinstance(section, dict):
        raise ConfigError(f"method must be a mapping with 'name' or 'import', got {section!r}")
    try:
        spec = method_spec(section)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return _merge_defaults(spec.config, data)


def _merge_defaults(defaults: dict, data: dict) -> dict:
    out = dict(data)
    for k, v in defaults.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge_defaults(v, out[k])
        elif out.get(k) is None:
            out[k] = v
    return out


def _parse_override_value(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``section.key=value`` strings (values parsed as YAML) to the raw config dict."""
    data = dict(data or {})
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} must look like section.key=value")
        key, text = ov.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {ov!r}: empty key part")
        node = data
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(f"override {ov!r}: {p} is not a section")
            node[p] = dict(nxt)
            node = node[p]
        node[parts[-1]] = _parse_override_value(text)
    return data


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> TrainConfig:
    """Read the YAML file with its ``base:`` layers (relative data paths resolved against the file
    that writes them; see config_layers), apply overrides (cwd-relative) and validate."""
    from megarl.trainer.config_layers import read_layered_config

    return from_dict(apply_overrides(read_layered_config(path), overrides or []))


def to_dict(cfg: TrainConfig) -> dict:
    """The resolved config as plain data (what ``save_resolved`` writes)."""
    d = _flat(cfg)
    adv = d.pop("advantage")
    d["advantage"] = {"estimator": adv["estimator"], **adv["knobs"]}
    return d


def _flat(obj: Any) -> Any:
    """A section as plain data, the contributed sections and keys written where the YAML has them."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return _plain(obj)
    out: dict = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.metadata.get(CONTRIBUTED):
            out.update({name: _flat(sec) for name, sec in v.items()})
        elif f.metadata.get(CHOSEN_BY):
            out.update(_flat(v) if v is not None else {})
        else:
            out[f.name] = _flat(v)
    return out


def _plain(v: Any) -> Any:
    """Lists and mappings with their dataclass items as plain data; other values as they are."""
    if isinstance(v, list):
        return [_flat(x) for x in v]
    if isinstance(v, dict):
        return {k: _flat(x) for k, x in v.items()}
    return v


def save_resolved(cfg: TrainConfig, run_dir: str | os.PathLike) -> Path:
    """Write ``run_dir/config.resolved.yaml`` (every default filled in)."""
    out = Path(run_dir) / "config.resolved.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    os.replace(tmp, out)
    return out
