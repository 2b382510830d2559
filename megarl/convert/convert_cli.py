"""``megarl convert``: Hugging Face <-> Megatron distributed checkpoints, at any TP/PP/EP layout.

    megarl convert hf-to-megatron --hf HF_DIR --out CKPT_DIR [--tp N --pp N --ep N]
    megarl convert megatron-to-hf --ckpt CKPT_OR_RUN_DIR --out HF_DIR [--hf-config PATH] [--tp ...]

One process converts at TP = PP = EP = 1; under ``torchrun --nproc-per-node N -m megarl.cli
convert ...`` the layout flags shard the work (the world must be a multiple of tp x pp).
Exit codes: 0 done, 2 bad input (the message names the path or value; no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

PROG = "megarl convert"

_DESCRIPTION = """\
Convert checkpoints between Hugging Face safetensors and Megatron distributed checkpoints
(megatron-core dist_checkpointing, the format of the learner's checkpoints).

  hf-to-megatron   HF model directory -> Megatron checkpoint (model weights only)
  megatron-to-hf   Megatron checkpoint, run checkpoint or run directory -> HF model directory

Run in one process, or under torchrun to shard the model:
  torchrun --nproc-per-node 2 -m megarl.cli convert hf-to-megatron --hf HF_DIR --out CKPT --tp 2

A Megatron checkpoint written at one layout loads at any other (dist_checkpointing reshards).
Exit codes: 0 done, 2 bad input. See docs/conversion.md."""

_H2M = """\
Write the model weights of HF_DIR (config.json + *.safetensors) as a Megatron checkpoint: the
"model" part of a learner checkpoint (same keys) plus megarl.json (step 0, layout, HF config,
"contents": ["model"]). It holds NO optimizer, scheduler or RNG state: `megarl train` cannot resume
from it (a run starts from the HF directory); megarl.learner.dist_checkpoint.load_checkpoint loads
its weights into a learner with a fresh optimizer, or convert it back with megatron-to-hf."""

_M2H = """\
Write the model weights of a Megatron checkpoint as a HF model directory (config.json,
model-NNNNN.safetensors, model.safetensors.index.json). CKPT may be
  - a checkpoint written by hf-to-megatron, or any learner checkpoint (a directory with megarl.json);
  - a run checkpoint, runs/X/checkpoints/step_000010 (its learner/ part is read);
  - a run directory, runs/X (its newest complete checkpoint).
Only the model weights are read; optimizer and scheduler state are ignored. The HF config comes from
--hf-config, else the checkpoint's megarl.json, else the run's init_policy/config.json; tokenizer and
generation_config files are copied from the --hf-config directory or the run's init_policy/."""


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout (under torchrun: world size = tp x pp x dp)")
    g.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    g.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
    g.add_argument("--ep", type=int, default=1, help="expert parallel size, MoE models only (default 1)")
    g.add_argument(
        "--expert-tp",
        type=int,
        default=None,
        help="tensor parallel size inside experts (default: --tp); needs --ep > 1 when it differs",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing non-empty --out (default: refuse). The new output is written "
        "into a temporary directory beside --out and renamed over it when complete",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``megarl convert`` argument parser (two subcommands)."""
    fmt = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(prog=PROG, description=_DESCRIPTION, formatter_class=fmt)
    sub = ap.add_subparsers(dest="command", metavar="{hf-to-megatron,megatron-to-hf}")
    sub.required = True
    h2m = sub.add_parser(
        "hf-to-megatron",
        description=_H2M,
        formatter_class=fmt,
        help="HF model directory -> Megatron checkpoint (model weights only)",
    )
    h2m.add_argument(
        "--hf", required=True, metavar="HF_DIR", help="HF model directory (config.json + *.safetensors)"
    )
    h2m.add_argument(
        "--out", required=True, metavar="CKPT_DIR", help="Megatron checkpoint directory to write"
    )
    h2m.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="dtype of the Megatron weights (default: the HF tensors' dtype, float32 if mixed)",
    )
    _add_common(h2m)
    m2h = sub.add_parser(
        "megatron-to-hf",
        help="Megatron / run checkpoint -> HF model directory",
        description=_M2H,
        formatter_class=fmt,
    )
    m2h.add_argument(
        "--ckpt",
        required=True,
        metavar="CKPT",
        help="Megatron checkpoint, run checkpoint (runs/X/checkpoints/step_N) or run directory",
    )
    m2h.add_argument("--out", required=True, metavar="HF_DIR", help="HF model directory to write")
    m2h.add_argument(
        "--hf-config",
        default=None,
        metavar="PATH",
        help="the model's HF config.json, or a HF directory holding one (default: from the checkpoint)",
    )
    m2h.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="dtype of the HF tensors (default: the dtype the checkpoint stores)",
    )
    m2h.add_argument(
        "--bucket-mb",
        type=int,
        default=512,
        help="largest safetensors file in MB (a bigger single tensor gets its own file; default 512)",
    )
    _add_common(m2h)
    return ap


def _input_errors() -> tuple[type, ...]:
    from megarl.convert.hf_megatron import ConversionError
    from megarl.convert.megatron_ckpt import MegatronCheckpointError
    from megarl.convert.paths import ConvertInputError
    from megarl.learner.model import HFConfigError

    return ConvertInputError, ConversionError, HFConfigError, MegatronCheckpointError


def _report(msg: str) -> None:
    """Print an error: every rank once a process group runs (prefixed), else rank 0 only (checks
    before the process group are the same on every rank)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        print(f"{PROG}: error: [rank {dist.get_rank()}] {msg}", file=sys.stderr, flush=True)
    elif os.environ.get("RANK", "0") == "0":
        print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)


# Warnings every CPU run of megatron-core prints, about fallbacks that do not matter for conversion.
_KNOWN_WARNINGS = (
    r".*Apex (is|are) not installed",
    r".*Transformer Engine and Apex are not installed",
    r".*`load_state_dict` is deprecated",
    r".*Please use DTensor instead",
    r".*full scope is deprecated",
)


def _quiet_known_warnings() -> None:
    for pattern in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def _run(args: argparse.Namespace, layout, commands, errors: tuple[type, ...]) -> None:
    if args.command == "hf-to-megatron":
        commands.hf_to_megatron(args.hf, args.out, layout, args.dtype, args.overwrite)
    else:
        if args.bucket_mb < 1:
            raise errors[0](f"--bucket-mb {args.bucket_mb}: must be >= 1")
        commands.megatron_to_hf(
            args.ckpt, args.out, layout, args.hf_config, args.dtype, args.overwrite, bucket_mb=args.bucket_mb
        )


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run one conversion; returns the exit code (0 done, 2 bad input)."""
    args = build_parser().parse_args(argv)
    from megarl.convert import commands

    layout = commands.LayoutArgs(tp=args.tp, pp=args.pp, ep=args.ep, expert_tp=args.expert_tp)
    errors = _input_errors()
    try:
        with warnings.catch_warnings():
            _quiet_known_warnings()
            _run(args, layout, commands, errors)
    except errors as e:
        _report(str(e))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
