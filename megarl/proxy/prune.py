"""Build a proxy MoE by clustering-based expert pruning (``megarl proxy prune``).

Per MoE layer: statistics of every routed expert on calibration tokens (``stats.py``), features
``[unit(output signature); kappa * unit(router row)]``, ``E'`` clusters (agglomerative or k-means,
inside each routing group), one representative per cluster kept bit-exactly (pruning, never
merging), router rows and per-expert router tensors sliced to the kept set in the same order,
config rewritten. Everything else in the checkpoint is copied byte for byte.

Order of work: every check on the request (config, checkpoint headers, expert counts, EP and
routing-group divisibility, calibration text and its tokenization) runs before the model is
loaded; the output is written to a temporary sibling directory renamed at the end, and the
source directory is only read.
"""

from __future__ import annotations

import json
import numbers
import os
import time

import numpy as np
import torch

from megarl.proxy.cluster import METHODS, REPRESENTATIVES, cluster_layer, expert_features
from megarl.proxy.hf_expert_files import (
    EXPERT_COUNT_KEYS,
    CheckpointIndex,
    MoEConfig,
    ProxyInputError,
    moe_layout,
    pruned_tensor_plan,
    read_moe_config,
    scan_checkpoint,
    write_pruned_checkpoint,
)
from megarl.proxy.report import coverage, layer_expert_table, param_flop_summary, reductions
from megarl.proxy.stats import collect_expert_stats, read_calibration_texts, tokenize_calibration

REPORT_NAME = "proxy_report.json"
REPORT_FORMAT = "megarl-proxy-report/1"


def check_request(
    cfg: MoEConfig, num_experts: int, ep_size: int, clamp_topk: bool, allow_identity: bool
) -> tuple[int, list[str]]:
    """Validate the target expert count against the config; returns ``(top_k', warnings)``.

    Errors: E' not a positive integer, E' > E, E' = E (unless ``allow_identity``), E' < top-k
    (unless ``clamp_topk``: then top-k' = E' and a warning; E' = top-k warns too), E' not
    divisible by ``ep_size`` or by the routing groups, fewer than 2 experts per routing group
    (group scores use the top 2), and top-k' larger than what ``topk_group`` groups can hold.
    """
    E, k, where = cfg.num_experts, cfg.top_k, "config.json"
    warnings: list[str] = []
    if isinstance(num_experts, bool) or not isinstance(num_experts, numbers.Integral) or num_experts < 1:
        raise ProxyInputError(f"--experts {num_experts!r}: must be a positive integer")
    if num_experts > E:
        raise ProxyInputError(f"--experts {num_experts} exceeds the model's {E} routed experts ({where})")
    if num_experts == E and not allow_identity:
        raise ProxyInputError(
            f"--experts {num_experts} equals the model's expert count ({where}): nothing to prune"
            " (pass --allow-identity for an unpruned control copy)"
        )
    if ep_size < 1 or num_experts % ep_size:
        raise ProxyInputError(f"--experts {num_experts} is not divisible by --ep-size {ep_size}")
    new_k = k
    if num_experts < k:
        if not clamp_topk:
            raise ProxyInputError(
                f"--experts {num_experts} is below num_experts_per_tok={k} ({where}); "
                "pass --clamp-topk to set top-k to E' (changes the routing)"
            )
        new_k = num_experts
        warnings.append(
            f"top-k clamped from {k} to {num_experts}: every token now uses all experts "
            "(routing differs from the original)"
        )
    elif num_experts == k:
        warnings.append(
            f"--experts {num_experts} = num_experts_per_tok: every token is routed to all {num_experts} "
            "kept experts, so the router no longer selects and routing differs from the original "
            "(only the gate weights still vary); the report's coverage says how many tokens keep "
            "their experts"
        )
    if cfg.n_group > 1:
        G = cfg.n_group
        if num_experts % G:
            raise ProxyInputError(
                f"--experts {num_experts} is not divisible by n_group={G} ({where}): "
                "each routing group must keep the same number of experts"
            )
        if num_experts // G < 2:
            raise ProxyInputError(
                f"--experts {num_experts} leaves {num_experts // G} expert(s) per routing group "
                f"(n_group={G}, {where}); group-limited routing scores groups by their top 2"
            )
        if new_k > cfg.topk_group * (num_experts // G):
            raise ProxyInputError(
                f"num_experts_per_tok={new_k} exceeds topk_group={cfg.topk_group} x "
                f"{num_experts // G} experts per group after pruning ({where})"
            )
    if cfg.scoring == "softmax" and not cfg.norm_topk_prob and cfg.model_type == "qwen3_moe":
        warnings.append(
            "norm_topk_prob=false: gates are softmax over all experts without renormalisation, so the "
            "pruned softmax denominator makes every kept expert's gate larger than in the original; "
            "MoE outputs are not preserved even for tokens whose top-k is kept"
        )
    return new_k, warnings


def _check_out_dir(src_dir: str, out_dir: str) -> None:
    s, o = os.path.realpath(src_dir), os.path.realpath(out_dir)
    if o == s or o.startswith(s + os.sep):
        raise ProxyInputError(
            f"--out {out_dir} is inside the source model directory {src_dir}; "
            "the original checkpoint is never modified"
        )
    if os.path.exists(out_dir):
        raise ProxyInputError(f"--out {out_dir} exists; refusing to overwrite")
    parent = os.path.dirname(o) or "."
    if not os.path.isdir(parent):
        raise ProxyInputError(f"--out {out_dir}: parent directory {parent} does not exist")


def new_config(cfg: MoEConfig, num_experts: int, top_k: int) -> tuple[dict, dict]:
    """The proxy's config.json and the changed keys (``key -> [old, new]``)."""
    out = dict(cfg.raw)
    changes = {}
    for key in EXPERT_COUNT_KEYS:
        if out.get(key):
            changes[key] = [out[key], num_experts]
            out[key] = num_experts
    if top_k != cfg.top_k:
        changes["num_experts_per_tok"] = [cfg.top_k, top_k]
        out["num_experts_per_tok"] = top_k
    return out, changes


def prune_moe_checkpoint(
    src_dir: str,
    out_dir: str,
    num_experts: int,
    calib: str | list[str],
    *,
    method: str = "agglomerative",
    seed: int = 0,
    ep_size: int = 1,
    max_calib_tokens: int = 4096,
    representative: str = "mass",
    kappa: float = 1.0,
    clamp_topk: bool = False,
    allow_identity: bool = False,
    seq_len: int = 256,
) -> dict:
    """Prune every MoE layer of the HF checkpoint ``src_dir`` to ``num_experts`` routed experts.

    ``calib``: a ``.jsonl`` (``text`` or ``prompt`` field), ``.json`` list or ``.txt`` path, or a
    list of strings; at most ``max_calib_tokens`` tokens are used. ``method``: agglomerative
    (average linkage) or kmeans (k-means++, seeded by ``seed``). ``representative``: ``mass``
    (highest routing mass in the cluster) or ``medoid``. ``ep_size``: the proxy's target
    expert-parallel size (E' must divide by it). Writes ``out_dir`` (config, safetensors, tokenizer
    files, ``proxy_report.json``) atomically and returns the report dict.
    """
    t0 = time.time()
    src_dir, out_dir = os.fspath(src_dir), os.fspath(out_dir)
    if not os.path.isdir(src_dir):
        raise ProxyInputError(f"--model {src_dir}: not a directory")
    if method not in METHODS:
        raise ProxyInputError(f"--method {method!r}; allowed: {', '.join(METHODS)}")
    if representative not in REPRESENTATIVES:
        raise ProxyInputError(f"--representative {representative!r}; allowed: {', '.join(REPRESENTATIVES)}")
    if max_calib_tokens < 2:
        raise ProxyInputError(f"max_calib_tokens={max_calib_tokens}: need at least 2")
    cfg = read_moe_config(src_dir)
    new_k, warnings = check_request(cfg, num_experts, ep_size, clamp_topk, allow_identity)
    num_experts = int(num_experts)
    _check_out_dir(src_dir, out_dir)
    index: CheckpointIndex = scan_checkpoint(src_dir)
    layout = moe_layout(index, cfg.num_experts)
    texts = read_calibration_texts(calib)
    vocab = int(cfg.raw.get("vocab_size") or 0)
    if vocab <= 0:
        raise ProxyInputError(f"{src_dir}/config.json: key 'vocab_size' missing")
    sequences = tokenize_calibration(texts, src_dir, vocab, max_calib_tokens, seq_len)

    # ---- the work: statistics, clustering, slicing
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32).eval()
    stats = collect_expert_stats(model, sequences, sorted(layout))
    del model
    kept_by_layer: dict[int, list[int]] = {}
    layers_report = []
    for layer in sorted(layout):
        st = stats[layer]
        phi = expert_features(st.out_signature, st.router_rows, kappa)
        clusters, reps = cluster_layer(
            phi,
            num_experts,
            method=method,
            seed=seed,
            n_group=cfg.n_group,
            mass=st.mass,
            saliency=st.saliency,
            representative=representative,
        )
        order = sorted(range(len(reps)), key=lambda c: reps[c])  # new index j = rank of the kept id
        kept = [reps[c] for c in order]
        kept_by_layer[layer] = kept
        layers_report.append(
            {
                "layer": layer,
                "kept": kept,
                "clusters": [clusters[c] for c in order],
                "new_index": {str(e): j for j, e in enumerate(kept)},
                "coverage": coverage(st.topk, st.gates, kept, cfg.num_experts),
                "experts": layer_expert_table(st.count, st.mass, st.mean_gate, st.saliency, st.tokens),
            }
        )
    plan = pruned_tensor_plan(index, layout, kept_by_layer)
    config, changes = new_config(cfg, num_experts, new_k)
    new_shapes = {}
    for new, (src, rows) in plan.items():
        shp = index.shapes[src]
        new_shapes[new] = shp if rows is None else (len(rows),) + tuple(shp[1:])
    orig_pf = param_flop_summary(index.shapes, cfg.num_experts, cfg.top_k)
    proxy_pf = param_flop_summary(new_shapes, num_experts, new_k)
    cov_keys = ("routing_mass_covered", "token_assignments_covered", "tokens_fully_covered")
    report = {
        "format": REPORT_FORMAT,
        "source": os.path.abspath(src_dir),
        "output": os.path.abspath(out_dir),
        "model_type": cfg.model_type,
        "num_experts": {"original": cfg.num_experts, "proxy": num_experts},
        "top_k": {"original": cfg.top_k, "proxy": new_k},
        "routing": {
            "scoring": cfg.scoring,
            "norm_topk_prob": cfg.norm_topk_prob,
            "n_group": cfg.n_group,
            "topk_group": cfg.topk_group,
        },
        "ep_size": ep_size,
        "experts_per_ep_rank": num_experts // ep_size,
        "method": method,
        "seed": seed,
        "representative": {
            "mass": "highest routing mass (sum of gate weights on calibration tokens) in the "
            "cluster; ties: saliency, then lowest id",
            "medoid": "smallest summed 1-cos distance to the cluster's members",
        }[representative],
        "features": (
            f"[unit(mean expert output over all calibration tokens); {kappa} * unit(router row)], 1-cos"
        ),
        "calibration": {
            "texts": len(texts),
            "sequences": len(sequences),
            "tokens": int(sum(len(s) for s in sequences)),
            "seq_len": seq_len,
            "source": (
                f"list of {len(calib)} strings" if isinstance(calib, (list, tuple)) else os.fspath(calib)
            ),
        },
        "config_changes": changes,
        "warnings": warnings,
        "coverage_mean": {
            k: round(float(np.mean([lr["coverage"][k] for lr in layers_report])), 6) for k in cov_keys
        },
        "params_flops": reductions(orig_pf, proxy_pf),
        "tensors": {
            "copied_verbatim": sum(1 for s, r in plan.values() if r is None),
            "row_sliced": sum(1 for s, r in plan.values() if r is not None),
            "original": len(index.shapes),
            "proxy": len(plan),
        },
        "layers": layers_report,
    }
    report["seconds"] = round(time.time() - t0, 2)
    write_pruned_checkpoint(index, plan, config, out_dir, {REPORT_NAME: json.dumps(report, indent=1)})
    return report
