"""Parameter and FLOP accounting of a MoE checkpoint, and the routing coverage of a kept set.

Counts come from tensor shapes only (``name -> shape``). FLOPs are the forward matmul FLOPs per
token, ``2 x`` the weights a token multiplies with: every non-expert matrix (attention, dense MLPs,
shared experts, router, LM head; not the embedding lookup unless the LM head is tied to it, not
1-D norm / bias vectors) plus ``top_k`` routed experts per MoE layer. Attention-score FLOPs grow
with the context length and do not change under pruning; they are left out (so the ratios below
are exact for the weights and a bound for the whole step).
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch

_EXPERT_KEY = re.compile(r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.")
_ROUTER_KEY = re.compile(r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.gate\.")


def param_flop_summary(shapes: dict[str, tuple[int, ...]], num_experts: int, top_k: int) -> dict:
    """Total / routed-expert / router / other parameter counts, active parameters per token and
    forward matmul FLOPs per token of a checkpoint given by ``shapes`` (name -> shape)."""
    n = {k: math.prod(s) for k, s in shapes.items()}
    experts = sum(v for k, v in n.items() if _EXPERT_KEY.match(k))
    router = sum(v for k, v in n.items() if _ROUTER_KEY.match(k))
    tied = "lm_head.weight" not in shapes
    matmul_other = sum(
        v
        for k, v in n.items()
        if not _EXPERT_KEY.match(k) and len(shapes[k]) >= 2 and (k != "model.embed_tokens.weight" or tied)
    )
    total = sum(n.values())
    active_experts = experts * top_k / num_experts
    return {
        "total_params": total,
        "routed_expert_params": experts,
        "router_params": router,
        "other_params": total - experts - router,
        "active_params_per_token": int(total - experts + active_experts),
        "forward_matmul_flops_per_token": int(2 * (matmul_other + active_experts)),
    }


def reductions(orig: dict, proxy: dict) -> dict:
    """Ratios proxy / original and the relative savings of the ``param_flop_summary`` figures."""
    out = {}
    for key in (
        "total_params",
        "routed_expert_params",
        "active_params_per_token",
        "forward_matmul_flops_per_token",
    ):
        r = proxy[key] / orig[key] if orig[key] else 1.0
        out[key] = {
            "original": orig[key],
            "proxy": proxy[key],
            "ratio": round(r, 6),
            "reduction": round(1 - r, 6),
        }
    return out


def coverage(topk: torch.Tensor, gates: torch.Tensor, kept: list[int], num_experts: int) -> dict:
    """How much of the original routing the kept experts carry, on the calibration tokens.

    topk, gates: [T, k] original routed expert ids and gate weights. ``routing_mass_covered``:
    share of all gate weight on kept experts; ``token_assignments_covered``: share of (token, slot)
    assignments to kept experts; ``tokens_fully_covered``: share of tokens whose whole top-k is
    kept (their MoE output is unchanged with renormalised top-k gates).
    """
    keep = torch.zeros(num_experts, dtype=torch.bool)
    keep[torch.tensor(kept, dtype=torch.long)] = True
    inside = keep[topk]  # [T, k]
    g = gates.double()
    return {
        "routing_mass_covered": round(float((g * inside).sum() / g.sum().clamp_min(1e-30)), 6),
        "token_assignments_covered": round(float(inside.double().mean()), 6),
        "tokens_fully_covered": round(float(inside.all(-1).double().mean()), 6),
    }


def layer_expert_table(
    count: np.ndarray, mass: np.ndarray, mean_gate: np.ndarray, saliency: np.ndarray, tokens: int
) -> list[dict]:
    """Per-expert statistics as JSON rows (frequency, mass share, mean gate, saliency)."""
    total = float(mass.sum()) or 1.0
    return [
        {
            "expert": e,
            "freq": round(float(count[e]) / max(tokens, 1), 6),
            "mass_share": round(float(mass[e]) / total, 6),
            "mean_gate": round(float(mean_gate[e]), 6),
            "saliency": round(float(saliency[e]), 6),
        }
        for e in range(len(count))
    ]
