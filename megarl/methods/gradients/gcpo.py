"""GCPO: every optimizer update projected off the principal singular subspaces of the pretrained
weights, and the principal-subspace overlap (PSO) of the updates logged (reconstructed).

Bases: the top-``rank`` singular vectors of each transformer weight of the run's initial policy
(megarl.methods.gradients.subspace: gathered over TP, SVD once, kept sharded like the weight;
experts per expert under EP), computed at the first optimizer step from a forward-only learner
holding the initial policy, so a resumed run gets the same bases.

Around every optimizer step (``Learner.add_optimizer_hook``): the weights before the step are
kept; after it, the update ``ΔW = W − W_before`` of each weight gives its PSO
``rho_k · m n / k²`` (``rho_k = |U_kᵀ ΔW V_k|²_F / |ΔW|²_F``; 1 on average for an isotropic random
update), and with ``project: true`` the weight becomes ``W_before + (I − U_k U_kᵀ) ΔW (I − V_k V_kᵀ)``
(the final update, after Adam, so the constraint holds by construction). With bf16 weights the
projected weights are re-read into the optimizer's fp32 main copy.
Reference: reference/gradients.py (``principal_bases``, ``gcpo_project``, ``principal_overlap``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.methods.gradients.subspace import (
    MatrixBasis,
    compute_bases,
    group_sum,
    project_and_overlap,
    projected_parameters,
)
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodParts, MethodSpec


@dataclass
class GcpoKnobs(Knobs):
    """rank: k, the number of principal directions per weight (0: no constraint, plain updates);
    project: project the updates (false: only measure the overlap, the diagnostic)."""

    rank: int = 8
    project: bool = True

    def check(self) -> None:
        """Ranges."""
        if self.rank < 0:
            raise ValueError(f"rank={self.rank} must be >= 0")


class GcpoHook:
    """Optimizer hook (snapshot, overlap, projection) and step hook (the RL step's metrics)."""

    def __init__(self, ctx: Any, knobs: GcpoKnobs, bases: dict[str, MatrixBasis] | None = None):
        self.ctx, self.knobs = ctx, knobs
        self.bases = bases
        self._before: dict[str, torch.Tensor] = {}
        self._steps: list[tuple[float, float, float, float]] = []

    def _load_bases(self, learner: Any) -> dict[str, MatrixBasis]:
        if self.bases is None:  # from the initial policy, not the (possibly resumed) current weights
            initial = self.ctx.make_learner(self.ctx.hf_config, self.ctx.init_dir, trainable=False)
            self.bases = compute_bases(initial.model, learner.groups, self.knobs.rank)
            del initial
        return self.bases

    # ---------------------------------------------------------------- optimizer hook
    def before_optimizer_step(self, learner: Any) -> None:
        """Keep this rank's shard of every constrained weight."""
        bases = self._load_bases(learner)
        self._before = {n: p.detach().clone() for n, p in projected_parameters(learner.model) if n in bases}

    def after_optimizer_step(self, learner: Any, ok: bool) -> None:
        """Measure the update's overlap; project it when asked (collective over TP groups)."""
        if not ok:
            return
        total = torch.zeros(4, dtype=torch.float64)  # PSO sum, matrices, |ΔW|², |ΔW~|²
        worst = torch.zeros(1, dtype=torch.float64)
        for name, p in projected_parameters(learner.model):
            if name not in self._before:
                continue
            b = self.bases[name]
            old = self._before[name]
            update = p.detach().double() - old.double()
            projected, norm2, pso = project_and_overlap(update, b)
            if self.knobs.project:
                p.data.copy_((old.double() + projected).to(p.dtype))
            kept = float(group_sum(projected.pow(2).sum().reshape(1), b.group))
            if b.reports:
                total += torch.tensor([pso, 1.0, norm2, kept], dtype=torch.float64)
                worst[0] = max(float(worst[0]), pso)
        self._before = {}
        if self.knobs.project:
            learner.sync_main_params()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        pso_mean = float(total[0] / total[1]) if total[1] > 0 else 0.0
        kept = float(total[3] / total[2]) if total[2] > 0 else 1.0
        self._steps.append((pso_mean, float(worst[0]), kept, float(total[1])))

    # ---------------------------------------------------------------- step hook
    def before_train(self, step: int, batch: Any) -> Any:
        """Nothing to change in the batch."""
        return batch

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        """The overlap of this RL step's updates (mean over its optimizer steps; max of the max)."""
        if not self._steps:
            return {}
        n = len(self._steps)
        out = {
            "gcpo/pso_mean": sum(s[0] for s in self._steps) / n,
            "gcpo/pso_max": max(s[1] for s in self._steps),
            "gcpo/update_kept": sum(s[2] for s in self._steps) / n,
            "gcpo/matrices": self._steps[-1][3],
        }
        self._steps = []
        return out

    def state_dict(self) -> dict:
        """Stateless: the bases are recomputed from the initial policy."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


def build(ctx: Any, knobs: GcpoKnobs) -> MethodParts:
    """The GCPO hook, registered around the policy learner's optimizer steps."""
    hook = GcpoHook(ctx, knobs)
    if ctx.policy is not None:
        ctx.policy.add_optimizer_hook(hook)
    return MethodParts(step_hooks=[hook])


SPEC = MethodSpec(
    name="gcpo",
    summary="GCPO: updates projected off the pretrained weights' principal subspaces; PSO logged",
    provenance="reconstructed",
    knobs=GcpoKnobs,
    build=build,
)
