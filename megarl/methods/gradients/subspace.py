"""Principal singular subspaces of the pretrained weights, sharded like the weights, and the
bilateral projection and overlap of an update against them.

For every 2-D weight of the transformer layers (attention, dense MLP, each MoE expert; not the
embedding, the output layer, norms or the router) the full matrix W_0 [m, n] is gathered over its
tensor-parallel group (the expert-TP group for experts), its top-k singular vectors U_k [m, k] and
V_k [n, k] taken by a float64 SVD, and each rank keeps the rows of its shard: a column-parallel
weight (rows sharded) keeps its rows of U_k and all of V_k, a row-parallel one (columns sharded)
all of U_k and its rows of V_k. Megatron's own matrices are the unit (fused QKV, fused gate+up).

Projection ``(I − U Uᵀ) ΔW (I − V Vᵀ) = ΔW − U L − R Vᵀ + U C Vᵀ`` with ``L = Uᵀ ΔW`` [k, n],
``R = ΔW V`` [m, k], ``C = Uᵀ ΔW V`` [k, k]: the sharded dimension's partial products are summed
over the TP group (L for row shards, R for column shards); the rest is local.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megarl.ops import comm


@dataclass
class MatrixBasis:
    """One weight's principal bases on this rank. dim: the sharded dimension (0 rows, 1 columns,
    None whole); group: its TP group; shape: the full [m, n]; reports: this rank reports the
    matrix's metrics (one rank per matrix over TP and data-parallel copies)."""

    U: torch.Tensor
    V: torch.Tensor
    dim: int | None
    group: Any
    shape: tuple[int, int]
    reports: bool


def projected_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of the 2-D weights GCPO constrains (see the module docstring)."""
    out = []
    for name, p in model.named_parameters():
        if p.dim() != 2 or "decoder.layers." not in name or not name.endswith("weight"):
            continue
        if "router" in name or "norm" in name:
            continue
        out.append((name, p))
    return out


def shard_layout(name: str, param: torch.Tensor, groups: Any) -> tuple[int | None, Any, bool]:
    """(sharded dim or None, TP group, whether this rank reports the matrix) of a weight."""
    expert = ".experts." in name
    tp = groups.expt_tp if expert else groups.tp
    copies = groups.expt_dp if expert else groups.dp
    dim = getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None
    if comm.world_size(tp) == 1:
        dim = None
    return dim, tp if dim is not None else None, comm.rank(tp) == 0 and comm.rank(copies) == 0


def gather_shards(t: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """The full matrix from its shards along ``dim`` over ``group``."""
    return torch.cat(comm.all_gather(t.contiguous(), group), dim)


def compute_bases(model: torch.nn.Module, groups: Any, rank: int) -> dict[str, MatrixBasis]:
    """The top-``rank`` bases of every projected weight of ``model`` (collective over TP groups)."""
    out: dict[str, MatrixBasis] = {}
    for name, p in projected_parameters(model):
        dim, group, reports = shard_layout(name, p, groups)
        w = p.detach().double()
        full = gather_shards(w, dim, group) if dim is not None else w
        U, _, Vh = torch.linalg.svd(full, full_matrices=False)
        k = min(rank, U.shape[1])
        U, V = U[:, :k], Vh[:k].T
        if dim is not None:
            r, local = comm.rank(group), w.shape[dim]
            if dim == 0:
                U = U[r * local : (r + 1) * local]
            else:
                V = V[r * local : (r + 1) * local]
        U, V = U.contiguous().to(p.device), V.contiguous().to(p.device)
        out[name] = MatrixBasis(U, V, dim, group, tuple(full.shape), reports)
    return out


def group_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``t`` summed over ``group`` (unchanged when None)."""
    return comm.all_reduce(t, "sum", group) if group is not None else t


def project_and_overlap(update: torch.Tensor, b: MatrixBasis) -> tuple[torch.Tensor, float, float]:
    """(projected local update, its squared norm over the full matrix, the PSO of ``update``):
    the collective bilateral projection of this rank's shard ``update`` (float64) and the
    dimension-corrected overlap rho_k · m n / k² of the unprojected update (0 for k = 0 or ΔW = 0)."""
    U, V = b.U, b.V
    k = U.shape[1]
    norm2 = float(group_sum(update.pow(2).sum().reshape(1), b.group))
    if k == 0:
        return update, norm2, 0.0
    L = update.T @ U  # [n(_loc), k] = (Uᵀ ΔW)ᵀ
    R = update @ V  # [m(_loc), k]
    if b.dim == 0:
        L = group_sum(L, b.group)
    elif b.dim == 1:
        R = group_sum(R, b.group)
    C = U.T @ R if b.dim == 1 else L.T @ V  # [k, k], full on every rank
    projected = update - U @ L.T - R @ V.T + U @ C @ V.T
    m, n = b.shape
    pso = float(C.pow(2).sum()) / norm2 * m * n / k**2 if norm2 > 0 else 0.0
    return projected, norm2, pso
