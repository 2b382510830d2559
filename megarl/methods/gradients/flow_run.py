"""What the flow-model methods (LC-GRPO, FlowCTS) share in the RL loop: their common knobs, a
pretrained replicated flow model, and the step-hook side (a ``PolicyGate`` that holds the run's
language-model policy still while the flow model trains with its own Adam, saved in the method
state of every checkpoint). Plain PyTorch, replicated on every rank: not a Megatron model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.methods.gradients import flow_model as fm
from megarl.plugin.knobs import Knobs


@dataclass
class FlowKnobs(Knobs):
    """Knobs shared by the flow methods: seed; pretrain_steps, pretrain_lr (flow matching on the
    ring before RL); hidden (MLP width); steps (K sampling steps); batch; lr (Adam)."""

    seed: int = 0
    pretrain_steps: int = 400
    pretrain_lr: float = 2e-3
    hidden: int = 64
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


class FlowHook:
    """Common step-hook side of the flow methods: holds the language-model policy still, owns
    a flow model and its Adam, saves both in the method state."""

    prefix = "flow"

    def __init__(self, model: torch.nn.Module, lr: float):
        self.model = model
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)
        self.updates = 0

    def updates_policy(self, step: int) -> bool:
        """Never: the language-model policy is not what these methods train."""
        return False

    def before_train(self, step, batch):
        """Nothing to the language-model batch."""
        return batch

    def state_dict(self) -> dict:
        """The flow model, its optimizer and the update count."""
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.updates = int(state["updates"])
