"""Checks on a weights directory before an engine is asked to reload from it.

A failed reload is expensive (vLLM's engine dies on the next request), so the client checks the
directory first: it exists, has config.json, every safetensors file (and the shard index, if any)
is readable with a valid header, and the tensor names match the served model's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from megarl.rollout.types import WeightsDirError


def tensor_names(weights_dir: str | os.PathLike) -> set[str]:
    """Names of all tensors in a HF safetensors checkpoint directory (headers only, no data read)."""
    from safetensors import safe_open

    d = Path(weights_dir)
    files = sorted(d.glob("*.safetensors"))
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise WeightsDirError(f"{index}: unreadable shard index ({e})") from e
        wanted = sorted(set(weight_map.values()))
        missing = [f for f in wanted if not (d / f).exists()]
        if missing:
            raise WeightsDirError(f"{index}: shard file(s) {missing[:3]} listed in the index are missing")
        files = [d / f for f in wanted]
    if not files:
        raise WeightsDirError(f"{d}: no *.safetensors file")
    names: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                names.update(fh.keys())
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise WeightsDirError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from e
    return names


def check_weights_dir(
    weights_dir: str | os.PathLike, reference_names: Iterable[str] | None = None
) -> set[str]:
    """Raise ``WeightsDirError`` naming the problem unless ``weights_dir`` is a complete checkpoint.

    With ``reference_names`` (the served model's tensor names), the names must match exactly.
    Returns the tensor names found.
    """
    d = Path(weights_dir)
    if not d.is_dir():
        raise WeightsDirError(f"{d}: weights directory does not exist")
    if not os.access(d, os.R_OK | os.X_OK):
        raise WeightsDirError(f"{d}: weights directory is not readable")
    cfg = d / "config.json"
    if not cfg.is_file():
        raise WeightsDirError(f"{cfg}: missing (a weights directory needs the model config)")
    try:
        json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise WeightsDirError(f"{cfg}: not valid JSON ({e})") from e
    names = tensor_names(d)
    if reference_names is not None:
        ref = set(reference_names)
        missing, extra = sorted(ref - names), sorted(names - ref)
        if missing or extra:
            raise WeightsDirError(
                f"{d}: tensor names differ from the served model: missing {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, "
                f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}"
            )
    return names
