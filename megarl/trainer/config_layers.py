"""Config files in layers: a file may name ``base:`` files that it is laid over.

``base`` is a path (or a list of paths, applied in order) relative to the file that names it. The
layers are merged section by section, the naming file winning:

- mappings merge key by key, recursively; lists and scalars are replaced whole;
- an ``advantage`` section that names an ``estimator`` and an ``objective`` section that names a
  ``policy_loss`` replace the base's section whole: they describe one method, and the base method's
  knobs (``scale_by_std``, ``kl_coef``, ...) must not leak into another method's.

Relative data paths (``data.train``, ``data.eval``) are resolved against the directory of the file
that writes them, so a config runs the same from any working directory. Command-line overrides are
applied afterwards and stay relative to the working directory.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

from megarl.trainer.config_sections import ConfigError

BASE_KEY = "base"
DATA_PATH_KEYS = ("train", "eval")
# section -> the key that makes a layer's section a whole new method part (replaced, not merged)
REPLACED_WHEN_NAMED = {"advantage": "estimator", "objective": "policy_loss"}


def read_layered_config(path: str | os.PathLike) -> dict:
    """The raw config dict of the YAML file ``path`` with its ``base:`` chain merged under it and its
    relative data paths made absolute (see the module docstring)."""
    return _read(Path(path), ())


def merge_layers(base: dict, over: dict) -> dict:
    """``over`` laid over ``base`` (neither is modified): mappings merge, anything else is replaced,
    and a method-naming ``advantage``/``objective`` section replaces the base's whole."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        selector = REPLACED_WHEN_NAMED.get(key)
        named = selector is not None and isinstance(value, dict) and selector in value
        if isinstance(value, dict) and isinstance(out.get(key), dict) and not named:
            out[key] = _merge_mappings(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _merge_mappings(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge_mappings(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read(path: Path, chain: tuple[Path, ...]) -> dict:
    where = f" (the base of {chain[-1]})" if chain else ""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist{where}")
    real = path.resolve()
    if real in (p.resolve() for p in chain):
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"config files name each other as base in a cycle: {cycle}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping of sections, got {type(data).__name__}")
    _anchor_data_paths(data, path)
    bases = data.pop(BASE_KEY, None)
    if bases is None:
        return data
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not bases or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(f"{path}: base must be a config file path or a list of them, got {bases!r}")
    merged: dict[str, Any] = {}
    for b in bases:
        merged = merge_layers(merged, _read(path.parent / b, (*chain, path)))
    return merge_layers(merged, data)


def _anchor_data_paths(data: dict, path: Path) -> None:
    """Make the file's relative ``data.train``/``data.eval`` absolute against its directory."""
    section = data.get("data")
    if not isinstance(section, dict):
        return
    for key in DATA_PATH_KEYS:
        value = section.get(key)
        if isinstance(value, str) and value and not os.path.isabs(os.path.expanduser(value)):
            section[key] = str(path.parent.resolve() / value)


def docs_section() -> list[str]:
    """The "Layered configs" section of docs/configuration.md (markdown lines)."""
    return [
        "## Layered configs",
        "",
        "A config file may name `base:` files it is laid over: a path, or a list of paths applied in order, "
        "relative to the file that names them (a base may name its own base). Every "
        "`examples/methods/*.yaml` names `base: ../quickstart.yaml`, so "
        "`megarl train examples/methods/NAME.yaml` runs the quickstart with that method. Merge rules, the "
        "naming "
        "file winning: mappings merge key by key; lists (e.g. `reward.functions`) and scalars are replaced "
        "whole; an `advantage` section that names an `estimator` and an `objective` section that names a "
        "`policy_loss` replace the base's section whole (a method's knobs do not mix with another's), "
        "while one that names neither merges.",
        "",
        "Relative `data.train` and `data.eval` paths are resolved against the directory of the file that "
        "writes them, so a config runs the same from any working directory. Overrides on the command line "
        "(`section.key=value`) stay relative to the working directory, as does every other relative path "
        "(`logging.run_dir`, `model.hf_dir`, ...). `config.resolved.yaml` in the run directory holds the "
        "merged result.",
        "",
    ]
