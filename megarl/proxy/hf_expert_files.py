"""The routed-expert layout of a HF MoE checkpoint on disk, and writing its pruned copy.

Works on the safetensors files directly (no model instance), so every tensor that is not a routed
expert or a router row is copied byte for byte. Recognised names (``P`` = ``model.layers.{l}.mlp``
or ``model.layers.{l}.block_sparse_moe``):

- per-expert tensors ``P.experts.{e}.<name>`` (Qwen3-MoE / DeepSeek-V3 ``{gate,up,down}_proj.weight``,
  Mixtral ``w{1,2,3}.weight``): expert ``kept[j]`` is renamed to ``P.experts.{j}.<name>``;
- fused expert tensors ``P.experts.<name>`` with leading dimension E (``gate_up_proj: [E, 2I, H]``,
  ``down_proj: [E, H, I]``): rows ``kept`` are taken;
- router tensors ``P.gate.<name>`` with leading dimension E (``weight: [E, H]``,
  ``e_score_correction_bias: [E]``): rows ``kept`` are taken.

Anything else (attention, norms, embeddings, LM head, dense MLPs, shared experts) is untouched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field

import torch

WEIGHT_INDEX = "model.safetensors.index.json"
_EXPERT = re.compile(
    r"^(?P<pre>model\.layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe))\.experts\.(?P<e>\d+)\."
    r"(?P<rest>.+)$"
)
_FUSED = re.compile(
    r"^(?P<pre>model\.layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe))\.experts\.(?P<rest>[^.]+)$"
)
_ROUTER = re.compile(
    r"^(?P<pre>model\.layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe))\.gate\.(?P<rest>.+)$"
)
# config keys that hold the routed-expert count, by model type (all present ones are rewritten)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
SUPPORTED_MODEL_TYPES = ("qwen3_moe", "deepseek_v3", "mixtral")


class ProxyInputError(ValueError):
    """Bad input to the proxy tools; the message names the file, key or value at fault."""


@dataclass
class MoEConfig:
    """What pruning needs from a MoE config.json."""

    model_type: str
    num_experts: int
    top_k: int
    n_group: int = 1  # routing groups (DeepSeek-style group-limited routing); 1 = none
    topk_group: int = 1
    norm_topk_prob: bool = True
    scoring: str = "softmax"  # softmax | sigmoid
    hidden_act: str = "silu"
    raw: dict = field(default_factory=dict)


def read_moe_config(src_dir: str) -> MoEConfig:
    """Parse ``src_dir/config.json``; raise ``ProxyInputError`` for a missing file, an unsupported
    architecture or a dense model."""
    path = os.path.join(src_dir, "config.json")
    if not os.path.isfile(path):
        raise ProxyInputError(f"{path}: missing (not a HF model directory)")
    try:
        with open(path) as fh:
            raw = json.load(fh)
    except json.JSONDecodeError as e:
        raise ProxyInputError(f"{path}: not valid JSON ({e})") from None
    mt = raw.get("model_type")
    counts = {k: raw[k] for k in EXPERT_COUNT_KEYS if raw.get(k)}
    if not counts:
        raise ProxyInputError(
            f"{path}: dense model (model_type={mt!r}, none of {list(EXPERT_COUNT_KEYS)} is set);"
            " expert pruning needs a MoE checkpoint"
        )
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ProxyInputError(
            f"{path}: model_type={mt!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}"
        )
    if len(set(counts.values())) != 1:
        raise ProxyInputError(f"{path}: expert counts disagree: {counts}")
    E = int(next(iter(counts.values())))
    if "num_experts_per_tok" not in raw:
        raise ProxyInputError(f"{path}: key 'num_experts_per_tok' missing")
    cfg = MoEConfig(
        model_type=mt,
        num_experts=E,
        top_k=int(raw["num_experts_per_tok"]),
        raw=raw,
        hidden_act=raw.get("hidden_act", "silu"),
    )
    if mt == "deepseek_v3":
        cfg.n_group = int(raw.get("n_group") or 1)
        cfg.topk_group = int(raw.get("topk_group") or 1)
        cfg.norm_topk_prob = bool(raw.get("norm_topk_prob", True))
        cfg.scoring = "sigmoid"
    elif mt == "qwen3_moe":
        cfg.norm_topk_prob = bool(raw.get("norm_topk_prob", False))
    # mixtral: softmax over all experts, then renormalised over the top-k (norm_topk_prob by construction)
    return cfg


@dataclass
class CheckpointIndex:
    """Where each tensor of a safetensors checkpoint lives and its shape (headers only)."""

    dir: str
    files: list[str]
    where: dict[str, str]
    shapes: dict[str, tuple[int, ...]]


def scan_checkpoint(src_dir: str) -> CheckpointIndex:
    """Read the safetensors headers of ``src_dir``; errors name the missing or duplicated file/key."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(src_dir) if f.endswith(".safetensors"))
    if not files:
        other = [f for f in os.listdir(src_dir) if f.endswith((".bin", ".pt", ".pth"))]
        hint = f" (found {other}: convert to safetensors first)" if other else ""
        raise ProxyInputError(f"{src_dir}: no *.safetensors weight file{hint}")
    where: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(os.path.join(src_dir, f), framework="pt") as h:
            for k in h.keys():
                if k in where:
                    raise ProxyInputError(f"{src_dir}: tensor {k!r} is stored twice ({where[k]} and {f})")
                where[k] = f
                shapes[k] = tuple(h.get_slice(k).get_shape())
    idx = os.path.join(src_dir, WEIGHT_INDEX)
    if os.path.isfile(idx):
        with open(idx) as fh:
            wm = json.load(fh).get("weight_map", {})
        missing = sorted(set(wm) - set(where))
        if missing:
            raise ProxyInputError(f"{idx}: lists tensors that no file holds: {missing[:5]}")
    return CheckpointIndex(src_dir, files, where, shapes)


@dataclass
class MoELayerLayout:
    """One MoE layer's routed-expert tensors in the checkpoint."""

    layer: int
    prefix: str  # model.layers.{l}.mlp
    expert_params: list[str]  # per-expert names, e.g. gate_proj.weight (empty if fused)
    fused: list[str]  # fused expert tensor names under prefix.experts.
    router: list[str]  # names under prefix.gate. with leading dim E


def moe_layout(index: CheckpointIndex, num_experts: int) -> dict[int, MoELayerLayout]:
    """The MoE layers of the checkpoint, checked against ``num_experts``: every expert 0..E-1 has
    the same tensors, a router ``gate.weight: [E, H]`` exists, router tensors have leading dim E."""
    E = num_experts
    per: dict[int, dict] = {}
    for k, shape in index.shapes.items():
        for kind, rx in (("expert", _EXPERT), ("fused", _FUSED), ("router", _ROUTER)):
            m = rx.match(k)
            if m:
                d = per.setdefault(
                    int(m["layer"]), {"prefix": m["pre"], "expert": {}, "fused": [], "router": []}
                )
                if kind == "expert":
                    d["expert"].setdefault(int(m["e"]), set()).add(m["rest"])
                else:
                    if not shape or shape[0] != E:
                        raise ProxyInputError(
                            f"{index.dir}: tensor {k!r} has shape {list(shape)}; expected leading"
                            f" dimension num_experts={E}"
                        )
                    d[kind].append(m["rest"])
                break
    if not per:
        raise ProxyInputError(
            f"{index.dir}: no routed-expert tensors (model.layers.N.mlp.experts.*) in the "
            "checkpoint although config.json describes a MoE model"
        )
    out: dict[int, MoELayerLayout] = {}
    for layer, d in sorted(per.items()):
        ids = sorted(d["expert"])
        if d["expert"] and ids != list(range(E)):
            extra = sorted(set(ids) - set(range(E)))
            miss = sorted(set(range(E)) - set(ids))
            raise ProxyInputError(
                f"{index.dir}: layer {layer}: expert ids {ids[:3]}..{ids[-3:]} do not match "
                f"num_experts={E} (missing {miss[:5]}, beyond config {extra[:5]})"
            )
        names = sorted(d["expert"].get(0, set()))
        for e, s in d["expert"].items():
            if s != set(names):
                raise ProxyInputError(
                    f"{index.dir}: layer {layer} expert {e} has tensors {sorted(s)}, expert 0 has {names}"
                )
        if "weight" not in d["router"]:
            raise ProxyInputError(
                f"{index.dir}: layer {layer}: router tensor {d['prefix']}.gate.weight missing"
            )
        if not names and not d["fused"]:
            raise ProxyInputError(f"{index.dir}: layer {layer}: router but no expert tensors")
        out[layer] = MoELayerLayout(layer, d["prefix"], names, sorted(d["fused"]), sorted(d["router"]))
    return out


def pruned_tensor_plan(
    index: CheckpointIndex, layout: dict[int, MoELayerLayout], kept: dict[int, list[int]]
) -> dict[str, tuple[str, list[int] | None]]:
    """new name -> (source name, rows to take or None for a verbatim copy), over every tensor."""
    plan: dict[str, tuple[str, list[int] | None]] = {}
    handled: set[str] = set()
    for layer, lay in layout.items():
        keep = kept[layer]
        for j, e in enumerate(keep):
            for rest in lay.expert_params:
                src = f"{lay.prefix}.experts.{e}.{rest}"
                plan[f"{lay.prefix}.experts.{j}.{rest}"] = (src, None)
        for name in lay.fused:
            plan[f"{lay.prefix}.experts.{name}"] = (f"{lay.prefix}.experts.{name}", list(keep))
        for name in lay.router:
            plan[f"{lay.prefix}.gate.{name}"] = (f"{lay.prefix}.gate.{name}", list(keep))
        handled.update(
            k for k in index.shapes if k.startswith((lay.prefix + ".experts.", lay.prefix + ".gate."))
        )
    for k in index.shapes:
        if k not in handled:
            plan[k] = (k, None)
    return plan


def write_pruned_checkpoint(
    index: CheckpointIndex,
    plan: dict[str, tuple[str, list[int] | None]],
    config: dict,
    out_dir: str,
    extra_files: dict[str, str],
) -> dict[str, str]:
    """Write the pruned checkpoint atomically: everything goes to ``out_dir + '.tmp-proxy'``, which
    is renamed to ``out_dir`` at the end. Each source safetensors file gives one output file of the
    same name (its tensors renamed / row-sliced per ``plan``); an index json is written when the
    source had one or several files. Non-weight files of the source (tokenizer, generation config,
    chat template) are copied; ``extra_files`` (name -> text) are written too. Returns the weight map.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    tmp = out_dir.rstrip("/") + ".tmp-proxy"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        by_file: dict[str, list[str]] = {}
        for new, (src, _) in plan.items():
            by_file.setdefault(index.where[src], []).append(new)
        weight_map: dict[str, str] = {}
        total = 0
        for f in index.files:
            out: dict[str, torch.Tensor] = {}
            with safe_open(os.path.join(index.dir, f), framework="pt") as h:
                meta = h.metadata() or {}
                for new in sorted(by_file.get(f, [])):
                    src, rows = plan[new]
                    t = h.get_tensor(src)
                    out[new] = t if rows is None else t[torch.tensor(rows, dtype=torch.long)].contiguous()
                    total += out[new].numel() * out[new].element_size()
            if out:
                save_file(out, os.path.join(tmp, f), metadata=dict(meta, format=meta.get("format", "pt")))
                weight_map.update({k: f for k in out})
        if len(weight_map) and (
            len(index.files) > 1 or os.path.isfile(os.path.join(index.dir, WEIGHT_INDEX))
        ):
            with open(os.path.join(tmp, WEIGHT_INDEX), "w") as fh:
                json.dump(
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                    fh,
                    indent=2,
                )
        for name in sorted(os.listdir(index.dir)):
            p = os.path.join(index.dir, name)
            if (
                os.path.isfile(p)
                and not name.endswith(".safetensors")
                and name not in (WEIGHT_INDEX, "config.json")
                and name not in extra_files
            ):
                shutil.copyfile(p, os.path.join(tmp, name))
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(config, fh, indent=2)
        for name, text in extra_files.items():
            with open(os.path.join(tmp, name), "w") as fh:
                fh.write(text)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return weight_map
