"""Input checks, checkpoint discovery and atomic output directories for ``megarl convert``.

Nothing here imports torch or megatron: every check runs before a process group exists, on every
rank alike, so bad input ends all ranks with the same clear message (``ConvertInputError``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

META_FILE = "megarl.json"  # the learner checkpoint's metadata file (megarl.learner.dist_checkpoint.META_FILE)
TRAINER_STATE = "trainer.json"  # marks a complete run checkpoint step directory
INIT_POLICY = "init_policy"  # run_dir/init_policy: the run's HF start weights (config + tokenizer)
# Files of a HF model directory that are not weights: carried over to an exported HF directory.
HF_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


class ConvertInputError(ValueError):
    """Bad command-line input (a missing path, no config.json, a layout that does not fit); the
    message names the path or the value."""


def check_hf_dir(path: str) -> str:
    """``path`` as a HF model directory with ``config.json`` and ``*.safetensors``; else raise."""
    if not os.path.exists(path):
        raise ConvertInputError(f"{path}: no such directory")
    if not os.path.isdir(path):
        raise ConvertInputError(f"{path}: not a directory (expected a Hugging Face model directory)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConvertInputError(f"{path}: no config.json (expected a Hugging Face model directory)")
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise ConvertInputError(f"{path}: no *.safetensors file (only safetensors weights are read)")
    return path


def read_config_file(path: str) -> dict:
    """A HF config from a ``config.json`` path or a directory holding one; else raise."""
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(p):
        why = "no config.json" if os.path.exists(path) else "no such file"
        raise ConvertInputError(f"{path}: {why}")
    try:
        with open(p) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConvertInputError(f"{p}: not a readable JSON config ({e})") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ConvertInputError(f"{p}: not a Hugging Face model config (no 'model_type')")
    return cfg


def check_out_dir(path: str, overwrite: bool) -> str:
    """Refuse an existing non-empty ``path`` unless ``overwrite``; a file is always refused."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConvertInputError(f"{path}: exists and is not a directory")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise ConvertInputError(f"{path}: exists and is not empty (pass --overwrite to replace it)")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise ConvertInputError(f"{parent}: not a directory")
    return path


@dataclass(frozen=True)
class MegatronCheckpoint:
    """A resolved Megatron checkpoint: the learner checkpoint directory and what it says."""

    path: str  # the directory dist_checkpointing reads (holds megarl.json)
    meta: dict  # the parsed megarl.json
    run_dir: str | None  # the run directory when ``path`` is inside runs/X/checkpoints/step_N


def _latest_step_dir(run_dir: str) -> str | None:
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    steps = [
        (int(n[5:]), os.path.join(root, n))
        for n in os.listdir(root)
        if n.startswith("step_") and n[5:].isdigit() and os.path.isfile(os.path.join(root, n, TRAINER_STATE))
    ]
    return max(steps)[1] if steps else None


def resolve_megatron_checkpoint(path: str) -> MegatronCheckpoint:
    """Find the learner checkpoint behind ``path``: a checkpoint directory (``megarl.json``), a run
    checkpoint ``runs/X/checkpoints/step_N`` (its ``learner/``) or a run directory ``runs/X`` (its
    newest complete checkpoint). Raise ``ConvertInputError`` naming ``path`` otherwise."""
    if not os.path.exists(path):
        raise ConvertInputError(f"{path}: no such directory")
    if not os.path.isdir(path):
        raise ConvertInputError(f"{path}: not a directory (expected a Megatron checkpoint directory)")
    cand = path
    if not os.path.isfile(os.path.join(cand, META_FILE)):
        if os.path.isfile(os.path.join(cand, "learner", META_FILE)):
            cand = os.path.join(cand, "learner")
        else:
            step = _latest_step_dir(cand)
            if step is None:
                hint = " (an unfinished save?)" if path.rstrip("/").endswith(".tmp") else ""
                raise ConvertInputError(
                    f"{path}: not a Megatron checkpoint{hint}: no {META_FILE}, no learner/{META_FILE}, no "
                    f"checkpoints/step_*/{TRAINER_STATE} (expected a directory written by `megarl convert "
                    f"hf-to-megatron`, a run checkpoint runs/X/checkpoints/step_N or a run directory runs/X)"
                )
            cand = os.path.join(step, "learner")
            if not os.path.isfile(os.path.join(cand, META_FILE)):
                raise ConvertInputError(f"{cand}: no {META_FILE} (incomplete run checkpoint)")
    try:
        with open(os.path.join(cand, META_FILE)) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConvertInputError(f"{os.path.join(cand, META_FILE)}: unreadable ({e})") from None
    run_dir = None
    step_dir = os.path.dirname(os.path.abspath(cand))
    if os.path.basename(os.path.dirname(step_dir)) == "checkpoints":
        run_dir = os.path.dirname(os.path.dirname(step_dir))
    return MegatronCheckpoint(path=cand, meta=meta, run_dir=run_dir)


def hf_config_source(ckpt: MegatronCheckpoint, override: str | None) -> tuple[dict, str, str | None]:
    """The model's HF config for exporting ``ckpt``: ``(config, where it came from, directory to
    copy tokenizer files from or None)``. Order: ``override`` (a config.json or a directory), the
    checkpoint's own ``megarl.json``, the run's ``init_policy/config.json``."""
    if override is not None:
        cfg = read_config_file(override)
        return cfg, override, override if os.path.isdir(override) else os.path.dirname(override)
    init = os.path.join(ckpt.run_dir, INIT_POLICY) if ckpt.run_dir else None
    side = init if init and os.path.isdir(init) else None
    if isinstance(ckpt.meta.get("hf_config"), dict) and ckpt.meta["hf_config"].get("model_type"):
        return dict(ckpt.meta["hf_config"]), os.path.join(ckpt.path, META_FILE), side
    if init and os.path.isfile(os.path.join(init, "config.json")):
        return read_config_file(init), os.path.join(init, "config.json"), side
    raise ConvertInputError(
        f"{ckpt.path}: the checkpoint holds no HF config and no run "
        "init_policy/config.json was found; pass --hf-config CONFIG_JSON_OR_HF_DIR"
    )


def temp_dir_for(out: str) -> str:
    """The temporary sibling directory an output is written into before the final rename."""
    out = os.path.abspath(out)
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.megarl-convert-tmp")


def prepare_temp(out: str) -> str:
    """Create the parent of ``out`` and an empty temporary sibling (removing a crashed leftover)."""
    tmp = temp_dir_for(out)
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    for stale in (tmp, tmp + ".tmp-megarl"):
        if os.path.exists(stale):
            shutil.rmtree(stale)
    return tmp


def publish(tmp: str, out: str, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``out``. With ``overwrite`` an existing ``out`` is moved
    aside first and deleted after the rename, so ``out`` is always either old or new, complete."""
    out = os.path.abspath(out)
    if os.path.exists(out):
        if os.listdir(out) and not overwrite:
            raise ConvertInputError(
                f"{out}: appeared during the conversion and is not empty (pass --overwrite)"
            )
        old = tmp + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old)
    else:
        os.rename(tmp, out)


def copy_side_files(src_dir: str | None, dst_dir: str) -> list[str]:
    """Copy the tokenizer / generation-config files of ``src_dir`` (if any) into ``dst_dir``."""
    if not src_dir or not os.path.isdir(src_dir):
        return []
    copied = []
    for name in HF_SIDE_FILES:
        p = os.path.join(src_dir, name)
        if os.path.isfile(p):
            shutil.copy2(p, os.path.join(dst_dir, name))
            copied.append(name)
    return copied
