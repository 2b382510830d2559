"""Tiny Qwen3-MoE HF checkpoints for the fault tests: an original (random weights, built with
transformers) and a hand-made proxy keeping some of its routed experts bit-exactly."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_moe_dir(out: Path, experts: int = 8, topk: int = 2, layers: int = 2, seed: int = 0) -> Path:
    """A random-weight Qwen3-MoE written by ``save_pretrained`` (per-expert tensor names), with the
    char tokenizer: what ``megarl proxy demo-inputs`` writes."""
    from megarl.proxy.demo_inputs import write_tiny_moe

    return write_tiny_moe(out, experts=experts, top_k=topk, layers=layers, seed=seed)


def slice_experts(src: Path, dst: Path, keep: list[int]) -> Path:
    """A proxy by hand: experts ``keep`` of every MoE layer copied bit-exactly, renumbered 0..E'-1,
    router rows sliced the same way, everything else untouched; config rewritten."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        state.update(load_file(str(f)))
    out = {}
    for k, v in state.items():
        if ".mlp.experts." in k:
            head, rest = k.split(".mlp.experts.")
            e, tail = rest.split(".", 1)
            if int(e) in keep:
                out[f"{head}.mlp.experts.{keep.index(int(e))}.{tail}"] = v.clone()
        elif k.endswith(".mlp.gate.weight"):
            out[k] = v[keep].clone()
        else:
            out[k] = v
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg["num_experts"] = len(keep)
    if "num_local_experts" in cfg:  # transformers' Qwen3-MoE config writes both; the engine reads this one
        cfg["num_local_experts"] = len(keep)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst
