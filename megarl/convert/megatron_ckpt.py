"""Model-weights-only Megatron checkpoints, in the learner checkpoint's format.

A learner checkpoint (``megarl.learner.dist_checkpoint``) holds ``{"model", "optimizer", "scheduler",
"rng", "step"}`` saved with megatron-core ``dist_checkpointing`` plus ``megarl.json``. The converter
writes the ``"model"`` part only (same keys: ``GPTModel.sharded_state_dict()``) and a
``megarl.json`` with ``"contents": ["model"]``, and reads the ``"model"`` part of any learner
checkpoint, a converted one or a training run's. dist_checkpointing reshards on load, so the
layout (TP/PP/EP/DP) of the reader need not be the writer's.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import torch
import torch.distributed as dist

from megarl.convert.paths import META_FILE
from megarl.learner.dist_checkpoint import MODEL_ONLY


class MegatronCheckpointError(RuntimeError):
    """A checkpoint's model weights do not fit the model being loaded; the message names the path."""


def save_model_checkpoint(
    model: torch.nn.Module, groups, ckpt_dir: str, hf_config: dict, extra_meta: dict | None = None
) -> None:
    """Save ``model``'s weights (collective) into the existing empty directory ``ckpt_dir``.

    ``megarl.json`` records step 0, the layout, the world size, ``hf_config`` and
    ``contents: ["model"]`` (no optimizer, scheduler or RNG state)."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save({"model": model.sharded_state_dict()}, ckpt_dir)
    if dist.get_rank() == 0:
        meta = {
            "step": 0,
            "layout": asdict(groups.layout),
            "world_size": dist.get_world_size(),
            "hf_config": hf_config,
            "contents": MODEL_ONLY,
            "params_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        }
        meta.update(extra_meta or {})
        with open(os.path.join(ckpt_dir, META_FILE), "w") as f:
            json.dump(meta, f, indent=1)
    dist.barrier()


def checkpoint_params_dtype(ckpt_dir: str) -> torch.dtype:
    """The dtype the model weights of ``ckpt_dir`` are stored in (from dist_checkpointing's metadata)."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(ckpt_dir)
    for key in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"):
        if key in meta:
            return meta[key].dtype
    dtypes = {t.dtype for k, t in meta.items() if not k.startswith("optimizer.") and hasattr(t, "dtype")}
    if len(dtypes) == 1:
        return dtypes.pop()
    raise MegatronCheckpointError(
        f"{ckpt_dir}: cannot tell the weights' dtype (no embedding or final norm "
        f"tensor; dtypes {sorted(map(str, dtypes))}); pass --dtype"
    )


def _reason(e: BaseException) -> str:
    """The message of a loading error; torch.distributed.checkpoint wraps each rank's error (with
    its traceback) in one exception: take the first rank's message."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        return _reason(inner[0] if isinstance(inner, tuple) else inner)
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def load_model_weights(model: torch.nn.Module, ckpt_dir: str) -> None:
    """Load the ``"model"`` part of a learner checkpoint into ``model`` (collective; strict: every
    model parameter must be in the checkpoint with a fitting global shape). Optimizer, scheduler
    and RNG state in the checkpoint are ignored."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException as DCPException

    template = {"model": model.sharded_state_dict()}
    try:
        loaded = dist_checkpointing.load(template, ckpt_dir)
    except (CheckpointingException, KeyError, DCPException) as e:
        raise MegatronCheckpointError(
            f"{ckpt_dir}: the model weights do not fit this model (another architecture or HF config?): "
            f"{_reason(e)[:2000]}"
        ) from None
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise MegatronCheckpointError(f"{ckpt_dir}: model weights missing {missing}, unexpected {unexpected}")
