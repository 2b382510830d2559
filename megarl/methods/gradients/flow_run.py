"""What the flow-model methods (LC-GRPO, FlowCTS) share in the RL loop: their common knobs, the
flow model they train and its optimizer, and the step-hook side (a ``PolicyGate`` that holds the
run's language-model policy still while the flow model trains).

Two flow models (``method.model``):
- ``mlp``: a plain-PyTorch velocity MLP, replicated on every rank (same seeds, same result), with
  torch's Adam; saved in the method state of every checkpoint;
- ``megatron``: the tiny DiT on megatron-core (megarl/learner/flow_dit.py) under the run's process
  groups, TP-sharded like the policy, its experts split over the expert-parallel group, trained
  by megatron's optimizer with each data-parallel replica computing its share of the loss; saved
  per rank in a folder of every checkpoint (``ShardedState``).
Both offer the same small interface (``FlowTrainer``), so the methods' code is one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.methods.gradients import flow_model as fm
from megarl.plugin.knobs import Knobs

MODELS = ("mlp", "megatron")


@dataclass
class FlowKnobs(Knobs):
    """Knobs shared by the flow methods: seed; pretrain_steps, pretrain_lr (flow matching on the
    ring before RL); model: mlp | megatron; hidden (MLP / DiT width); layers, heads (the DiT's);
    experts (the DiT's: 0 dense, N experts, -1: 2·ep experts when the run's layout has ep > 1, else
    dense); micro_batches (the DiT's: each replica's share in this many backward passes); steps
    (K sampling steps); lr (Adam)."""

    seed: int = 0
    pretrain_steps: int = 400
    pretrain_lr: float = 2e-3
    model: str = "mlp"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    experts: int = -1
    micro_batches: int = 1
    steps: int = 10
    lr: float = 1e-3

    def check(self) -> None:
        """Ranges."""
        for k in ("pretrain_steps", "seed"):
            if getattr(self, k) < 0:
                raise ValueError(f"method.{k}={getattr(self, k)} must be >= 0")
        if self.hidden < 1 or self.steps < 2:
            raise ValueError(f"method.hidden >= 1 and method.steps >= 2, got {self.hidden}, {self.steps}")
        if not (self.lr > 0 and self.pretrain_lr > 0):
            raise ValueError("method.lr and method.pretrain_lr must be > 0")
        if self.model not in MODELS:
            raise ValueError(f"method.model={self.model!r}; known: {', '.join(MODELS)}")
        if self.layers < 1 or self.heads < 1 or self.experts < -1 or self.micro_batches < 1:
            raise ValueError(
                "method.layers >= 1, method.heads >= 1, method.experts >= -1 and method.micro_batches >= 1"
            )


def replicated_model(k: FlowKnobs, seed: int, pretrain_steps: int) -> fm.VelocityMLP:
    """A velocity MLP seeded by ``seed`` and pretrained by flow matching (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = fm.VelocityMLP(hidden=k.hidden)
    fm.pretrain(model, pretrain_steps, 256, k.pretrain_lr, gen)
    return model


def param_vector(model: torch.nn.Module) -> torch.Tensor:
    """The model's parameters, flattened (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


class PlainFlow:
    """A replicated plain-PyTorch flow model with torch's Adam (gradient norm clipped at 1): every
    rank computes the whole loss (its share is everything)."""

    def __init__(self, model: torch.nn.Module, lr: float):
        self.model = model
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)

    def __call__(self, x: torch.Tensor, t) -> torch.Tensor:
        """Velocities."""
        return self.model(x, t)

    def dp_share(self, n: int) -> torch.Tensor:
        """All ``n`` items."""
        return torch.arange(n)

    def all_reduce_dp(self, value: torch.Tensor) -> float:
        """The value itself (one replica)."""
        return float(value.detach())

    def micro_batches(self, part: torch.Tensor, n: int) -> list[torch.Tensor]:
        """The whole batch at once (a replicated model trains it in one pass)."""
        return [part]

    def train_step(self, loss_fns) -> tuple[float, float]:
        """One Adam step on the loss (one closure, or a list of one); returns (loss, grad norm
        before clipping)."""
        loss_fn = loss_fns[0] if isinstance(loss_fns, list) else loss_fns
        loss = loss_fn()
        self.opt.zero_grad()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return float(loss.detach()), float(gn)

    def flat(self) -> torch.Tensor:
        """The parameters, flattened."""
        return param_vector(self.model)


def make_flow(k: FlowKnobs, ctx, seed: int, pretrain_steps: int):
    """The flow model ``k.model`` names, pretrained: a ``PlainFlow`` or a ``FlowLearner`` under the
    run's process groups (``ctx.groups``)."""
    if k.model == "mlp":
        return PlainFlow(replicated_model(k, seed, pretrain_steps), k.lr)
    from megarl.methods.gradients.flow_megatron import megatron_flow

    return megatron_flow(k, getattr(ctx, "groups", None), seed, pretrain_steps)


def as_flow(model, lr: float):
    """A trainer for ``model``: an ``nn.Module`` gets a ``PlainFlow``; a flow learner is one."""
    return PlainFlow(model, lr) if isinstance(model, torch.nn.Module) else model


class FlowHook:
    """Common step-hook side of the flow methods: holds the language-model policy still, owns a
    flow model (``self.flow``, trainer included; ``self.model`` is what the samplers call)."""

    def __init__(self, flow):
        self.flow = flow
        self.model = flow.model if isinstance(flow, PlainFlow) else flow
        self.updates = 0

    def updates_policy(self, step: int) -> bool:
        """Never: the language-model policy is not what these methods train."""
        return False

    def before_train(self, step, batch):
        """Nothing to the language-model batch."""
        return batch

    def flow_metrics(self, prefix: str) -> dict[str, float]:
        """What trains: ``<prefix>/flow_experts`` (0: a dense model; the MLP is dense)."""
        experts = 0 if isinstance(self.flow, PlainFlow) else self.flow.spec.experts
        return {f"{prefix}/flow_experts": float(experts)}

    def state_dict(self) -> dict:
        """The update count; the replicated model and its optimizer (the sharded one: ``save_sharded``)."""
        if not isinstance(self.flow, PlainFlow):
            return {"updates": self.updates}
        model, opt = self.flow.model.state_dict(), self.flow.opt.state_dict()
        return {"model": model, "opt": opt, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""
        if isinstance(self.flow, PlainFlow):
            self.flow.model.load_state_dict(state["model"])
            self.flow.opt.load_state_dict(state["opt"])
        self.updates = int(state["updates"])
