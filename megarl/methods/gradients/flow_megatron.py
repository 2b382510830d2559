"""The flow methods' Megatron flow model: the tiny DiT (megarl/learner/flow_dit.py) built from the
method's knobs under the run's process groups, pretrained by flow matching on the ring with
megatron's optimizer (each data-parallel replica on its share of every batch), and the
``ShardedState`` side of a step hook that owns such models (per-rank files in a folder of every
run checkpoint)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from megarl.learner.flow_dit import FlowDiTSpec
from megarl.learner.flow_learner import FlowLearner, load_learners, save_learners
from megarl.methods.gradients import flow_model as fm

PRETRAIN_BATCH = 256


def dit_spec(k: Any, groups: Any) -> FlowDiTSpec:
    """The DiT of the knobs (``hidden``, ``layers``, ``heads``, ``experts``; -1 experts: 2·ep when
    the layout has ep > 1, else dense) for 2-D points, one coordinate per token."""
    ep = groups.layout.ep
    experts = (2 * ep if ep > 1 else 0) if k.experts == -1 else k.experts
    spec = FlowDiTSpec(dim=2, patch=1, hidden=k.hidden, layers=k.layers, heads=k.heads,
                       ffn=2 * k.hidden, experts=experts, topk=min(2, max(experts, 1)))  # fmt: skip
    spec.check(groups.layout.tp, ep, where="method (flow model)")
    return spec


def _distinct_experts(ln: FlowLearner, seed: int) -> None:
    """Re-draw each expert's weights from (seed, global expert index): the CPU initialisation
    draws every rank's local experts from the same stream, so experts on different EP ranks would
    start equal."""
    spec, lay = ln.spec, ln.groups.layout
    per, ep_rank = spec.experts // lay.ep, ln.groups.ep_rank
    std = ln.model.config.init_method_std
    with torch.no_grad():
        for name, p in ln.model.named_parameters():
            if "local_experts." not in name:
                continue
            local = int(name.split("local_experts.")[1].split(".")[0])
            layer = int(name.split("layers.")[1].split(".")[0])
            e = ep_rank * per + local
            gen = torch.Generator().manual_seed(((seed * 131 + layer) * 131 + e) * 2 + ("fc2" in name))
            scale = std / math.sqrt(2 * spec.layers) if "fc2" in name else std
            p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def pretrain(ln: FlowLearner, steps: int, gen: torch.Generator) -> float:
    """Flow matching on ``ring_data`` (every rank draws the same batch and trains on its
    data-parallel share); returns the last whole-batch loss."""
    loss = 0.0
    part = ln.dp_share(PRETRAIN_BATCH)
    for _ in range(steps):
        x0 = fm.ring_data(PRETRAIN_BATCH, gen)
        eps = torch.randn(PRETRAIN_BATCH, 2, generator=gen)
        t = torch.rand(PRETRAIN_BATCH, generator=gen)
        xt = (1 - t[:, None]) * x0 + t[:, None] * eps
        target = eps - x0

        def share(xt=xt, t=t, target=target) -> torch.Tensor:
            return ((ln(xt[part], t[part]) - target[part]) ** 2).sum() / PRETRAIN_BATCH

        loss, _ = ln.train_step(share)
    return loss


def megatron_flow(k: Any, groups: Any, seed: int, pretrain_steps: int) -> FlowLearner:
    """A DiT seeded by ``seed``, pretrained for ``pretrain_steps`` at ``k.pretrain_lr``, then with a
    fresh Adam at ``k.lr``. Collective."""
    if groups is None:
        raise ValueError("method.model=megatron needs the run's process groups (a run context with groups)")
    ln = FlowLearner(dit_spec(k, groups), groups, lr=k.pretrain_lr, seed=seed)
    if ln.spec.experts and groups.layout.ep > 1:
        _distinct_experts(ln, seed)
    pretrain(ln, pretrain_steps, torch.Generator().manual_seed(seed))
    ln.reset_optimizer(k.lr)
    return ln


class ShardedFlow:
    """Mixin of a flow step hook whose models are ``FlowLearner``s: ``sharded_learners()`` names
    them; they are saved per rank in the hook's folder of every run checkpoint."""

    def sharded_learners(self) -> dict[str, FlowLearner]:
        """The hook's flow learners by name."""
        return {"model": self.flow}

    def save_sharded(self, directory: Path) -> None:
        """Every rank's shards and optimizer state (collective)."""
        save_learners(Path(directory), self.sharded_learners())

    def load_sharded(self, directory: Path) -> None:
        """Restore ``save_sharded`` (the same layout)."""
        load_learners(Path(directory), self.sharded_learners())
