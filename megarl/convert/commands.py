"""The two conversions behind ``megarl convert``: HF directory -> Megatron checkpoint and back.

Both run on every rank of the world (one process, or ``torchrun --nproc-per-node N``) under the
layout asked for; TP x PP x EP need not match the layout the source was written with. The learner
is built directly (forward-only, no optimizer), exactly as training builds it, so the checkpoint
keys are the learner's own.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from megarl.convert import paths
from megarl.learner.model import ModelSpec, model_spec_from_hf
from megarl.learner.parallel import ParallelLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass(frozen=True)
class LayoutArgs:
    """The target layout as given on the command line."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    expert_tp: int | None = None


def world_size_from_env() -> int:
    """The world size torchrun announces (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def plan_layout(spec: ModelSpec, want: LayoutArgs, world: int, source: str) -> ParallelLayout:
    """The ``ParallelLayout`` for ``want`` on ``world`` ranks, checked against the model; raise
    ``ConvertInputError`` naming ``source`` (the config it came from) when it does not fit.

    Sequence parallelism is switched on for MoE with TP > 1 (megatron-core requires it; it does
    not change any weight)."""
    err = paths.ConvertInputError
    sizes = (("--tp", want.tp), ("--pp", want.pp), ("--ep", want.ep), ("--expert-tp", want.expert_tp or 1))
    for name, v in sizes:
        if v < 1:
            raise err(f"{name} {v}: must be >= 1")
    if spec.num_heads % want.tp or spec.num_kv_heads % want.tp:
        raise err(
            f"{source}: num_attention_heads {spec.num_heads} and num_key_value_heads "
            f"{spec.num_kv_heads} must be divisible by --tp {want.tp}"
        )
    if spec.vocab_size % want.tp:
        raise err(f"{source}: vocab_size {spec.vocab_size} is not divisible by --tp {want.tp}")
    if spec.num_layers % want.pp:
        raise err(f"{source}: num_hidden_layers {spec.num_layers} is not divisible by --pp {want.pp}")
    if want.ep > 1 and not spec.is_moe:
        raise err(f"{source}: --ep {want.ep} needs a MoE model (model_type {spec.model_type} has no experts)")
    if spec.is_moe and spec.num_experts % want.ep:
        raise err(f"{source}: num_experts {spec.num_experts} is not divisible by --ep {want.ep}")
    layout = ParallelLayout(
        tp=want.tp,
        pp=want.pp,
        ep=want.ep,
        expert_tp=want.expert_tp,
        sequence_parallel=spec.is_moe and want.tp > 1,
    )
    try:
        layout.data_parallel_size(world)
    except ValueError as e:
        raise err(f"layout does not fit {world} process(es) (torchrun --nproc-per-node): {e}") from None
    return layout


def _hf_dtype(hf_dir: str) -> torch.dtype:
    """The dtype of the floating-point tensors of a safetensors directory (float32 if mixed)."""
    from safetensors import safe_open

    seen = set()
    for f in sorted(os.listdir(hf_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, f), framework="pt") as h:
                for k in h.keys():
                    seen.add(h.get_slice(k).get_dtype())
    floats = {_SAFETENSORS_DTYPES[d] for d in seen if d in _SAFETENSORS_DTYPES}
    return floats.pop() if len(floats) == 1 else torch.float32


def _build_learner(hf_config: dict, layout: ParallelLayout, dtype: torch.dtype):
    from megarl.learner.learner import Learner, LearnerConfig
    from megarl.learner.parallel import initialize_parallel

    groups = initialize_parallel(layout)
    return Learner(
        LearnerConfig(hf_config=hf_config, params_dtype=dtype, trainable=False),
        groups,
        perform_initialization=False,
    )


def _is_rank0() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == 0


def _layout_str(layout: ParallelLayout, world: int) -> str:
    dp = layout.data_parallel_size(world)
    etp = f" expert_tp={layout.etp}" if layout.expert_tp is not None else ""
    return f"tp={layout.tp} pp={layout.pp} ep={layout.ep}{etp} dp={dp}"


def hf_to_megatron(
    hf_dir: str, out: str, want: LayoutArgs, dtype: str | None, overwrite: bool, log=print
) -> None:
    """Convert the HF model directory ``hf_dir`` into a Megatron checkpoint ``out`` (model weights
    only), sharded for ``want`` over the current world. Checks all input before any collective."""
    import torch.distributed as dist

    paths.check_hf_dir(hf_dir)
    paths.check_out_dir(out, overwrite)
    cfg = paths.read_config_file(hf_dir)
    spec = model_spec_from_hf(cfg)
    world = world_size_from_env()
    layout = plan_layout(spec, want, world, os.path.join(hf_dir, "config.json"))
    t0 = time.monotonic()
    params_dtype = DTYPES[dtype] if dtype else _hf_dtype(hf_dir)
    learner = _build_learner(cfg, layout, params_dtype)
    learner.load_hf(hf_dir)
    from megarl.convert.megatron_ckpt import save_model_checkpoint

    tmp = paths.temp_dir_for(out)
    if _is_rank0():
        paths.prepare_temp(out)
        os.makedirs(tmp)
    dist.barrier()
    save_model_checkpoint(
        learner.model, learner.groups, tmp, cfg, extra_meta={"converted_from": os.path.abspath(hf_dir)}
    )
    if _is_rank0():
        paths.publish(tmp, out, overwrite)
        n = sum(p.numel() for p in learner.model.parameters())
        log(
            f"megarl convert: {hf_dir} -> {out}: Megatron checkpoint (model weights, "
            f"{str(params_dtype)[6:]}), layout {_layout_str(layout, world)}; rank 0 holds {n:,} parameters; "
            f"{time.monotonic() - t0:.1f} s"
        )
    dist.barrier()


def megatron_to_hf(
    ckpt_path: str,
    out: str,
    want: LayoutArgs,
    hf_config: str | None,
    dtype: str | None,
    overwrite: bool,
    bucket_mb: int = 512,
    log=print,
) -> None:
    """Convert a Megatron checkpoint (a converted one, a learner checkpoint, a run checkpoint
    ``runs/X/checkpoints/step_N`` or a run directory) into the HF model directory ``out``, loading
    it under ``want`` over the current world. Checks all input before any collective."""
    import torch.distributed as dist

    ckpt = paths.resolve_megatron_checkpoint(ckpt_path)
    paths.check_out_dir(out, overwrite)
    cfg, cfg_from, side_dir = paths.hf_config_source(ckpt, hf_config)
    spec = model_spec_from_hf(cfg)
    world = world_size_from_env()
    layout = plan_layout(spec, want, world, cfg_from)
    t0 = time.monotonic()
    from megarl.convert.hf_megatron import save_hf_checkpoint
    from megarl.convert.megatron_ckpt import checkpoint_params_dtype, load_model_weights

    stored = checkpoint_params_dtype(ckpt.path)
    learner = _build_learner(cfg, layout, stored)
    load_model_weights(learner.model, ckpt.path)
    out_dtype = DTYPES[dtype] if dtype else stored
    if any(p.dtype != out_dtype for p in learner.model.parameters()):
        learner.model.to(out_dtype)  # one dtype in the HF files (a bf16 CPU model keeps fp32 norms)
    name = str(out_dtype).replace("torch.", "")
    for key in ("torch_dtype", "dtype"):
        if key in cfg:
            cfg[key] = name
    tmp = paths.temp_dir_for(out)
    if _is_rank0():
        paths.prepare_temp(out)
    dist.barrier()
    wmap = save_hf_checkpoint(
        learner.model, learner.groups, tmp, hf_config=cfg, bucket_bytes=bucket_mb * 2**20
    )
    if _is_rank0():
        copied = paths.copy_side_files(side_dir, tmp)
        paths.publish(tmp, out, overwrite)
        extra = f"; copied {', '.join(copied)} from {side_dir}" if copied else ""
        log(
            f"megarl convert: {ckpt.path} -> {out}: HF safetensors ({len(wmap)} tensors, {name}), "
            f"config from {cfg_from}, read at layout {_layout_str(layout, world)}{extra}; "
            f"{time.monotonic() - t0:.1f} s"
        )
    dist.barrier()
