"""The flow DiT as a learner: megatron DDP over the run's process groups and megatron's optimizer.

Every rank of a replica (its TP peers) computes the same loss; each data-parallel replica computes
its share of the batch's loss, normalised by the whole batch, so the sum over replicas is the
whole loss (the DDP buffers reduce with SUM: ``calculate_per_token_loss``, as the policy learner).
Expert gradients are reduced over the expert-data-parallel group by the same DDP. Its state (the
model's shards and the optimizer's) is saved per rank: a resume needs the same parallel layout.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.learner.flow_dit import FlowDiT, FlowDiTSpec

LossFn = Callable[[], torch.Tensor]
LossFns = LossFn | list[LossFn]


class FlowLearner:
    """A ``FlowDiT`` under ``groups`` with megatron's Adam (``lr``, gradient clipping at
    ``clip_grad``); ``trainable=False``: frozen, forward only. Collective: every rank of the world
    calls every method (a MoE forward is an alltoall over the expert group)."""

    def __init__(
        self,
        spec: FlowDiTSpec,
        groups: Any,
        lr: float = 1e-3,
        clip_grad: float = 1.0,
        params_dtype: torch.dtype = torch.float32,
        seed: int = 0,
        trainable: bool = True,
    ):
        from megatron.core.distributed import DistributedDataParallelConfig

        from megarl.learner.ddp import WeakHookDDP

        self.spec, self.groups, self.clip_grad, self.dtype = spec, groups, clip_grad, params_dtype
        torch.manual_seed(seed)
        self.model = FlowDiT(spec, groups, params_dtype)
        self.ddp = self.optimizer = None
        if not trainable:
            for p in self.model.parameters():
                p.requires_grad_(False)
            return
        self.model.config.calculate_per_token_loss = True  # DDP sums the replicas' shares
        self.ddp = WeakHookDDP(
            self.model.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=False,
                overlap_grad_reduce=False,
                use_distributed_optimizer=False,
                average_in_collective=False,
            ),
            self.model,
        )
        self.reset_optimizer(lr)

    def reset_optimizer(self, lr: float) -> None:
        """A fresh megatron Adam at ``lr`` (its moments zero)."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=lr, weight_decay=0.0, clip_grad=self.clip_grad,
            use_distributed_optimizer=False, params_dtype=self.dtype,
        )  # fmt: skip
        self.optimizer = get_megatron_optimizer(cfg, [self.ddp], use_gloo_process_groups=False)
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def __call__(self, x: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
        """Velocities of the model (the ``model(x, t)`` the samplers call)."""
        return self.model(x, t)

    def dp_share(self, n: int) -> torch.Tensor:
        """Indices of this data-parallel replica's share of ``n`` items."""
        return torch.arange(n).tensor_split(self.groups.dp_size)[self.groups.dp_rank]

    def all_reduce_dp(self, value: torch.Tensor) -> float:
        """A replica's share summed over the data-parallel replicas."""
        v = value.detach().double().reshape(1).clone().to(self.groups.device)
        if self.groups.dp_size > 1:
            dist.all_reduce(v, group=self.groups.dp)
        return float(v)

    def micro_batches(self, part: torch.Tensor, n: int) -> list[torch.Tensor]:
        """``part`` (this replica's share) in ``n`` micro-batches, none empty."""
        return list(part.tensor_split(max(1, min(n, len(part)))))

    def backward(self, loss_fns: LossFns) -> torch.Tensor:
        """Zero the gradients, back-propagate this rank's share (``loss_fns``: one closure, or one
        per micro-batch, their gradients accumulated in the DDP buffers) and reduce the gradients
        over the replicas (into each parameter's ``main_grad``); returns the share's loss."""
        from megatron.core.distributed import finalize_model_grads

        if self.ddp is None:
            raise RuntimeError("backward on a frozen flow learner (trainable=False)")
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        for fn in loss_fns if isinstance(loss_fns, (list, tuple)) else [loss_fns]:
            loss = fn()
            loss.backward()
            total = total + loss.detach().double().cpu()
        finalize_model_grads([self.ddp], num_tokens=None)
        return total

    def train_step(self, loss_fns: LossFns) -> tuple[float, float]:
        """One optimizer step on this rank's share (see ``backward``); returns (whole loss, grad norm)."""
        loss = self.backward(loss_fns)
        _, grad_norm, _ = self.optimizer.step()
        return self.all_reduce_dp(loss), float(grad_norm or 0.0)

    def flat(self) -> torch.Tensor:
        """The full parameters (shards gathered), flattened (collective)."""
        from megarl.learner.flow_dit import full_weights

        return torch.cat([t.reshape(-1) for t in full_weights(self.model, self.groups).values()])

    def state(self) -> dict:
        """This rank's model shards and optimizer state."""
        out = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.state_dict()
        return out

    def load(self, state: dict) -> None:
        """Restore ``state()`` (the same layout)."""
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            if hasattr(self.optimizer, "reload_model_params"):
                self.optimizer.reload_model_params()


def save_learners(directory: Path, learners: dict[str, FlowLearner], extra: dict | None = None) -> None:
    """Every rank writes its shards of ``learners`` (and ``extra``) to ``directory/rank_NNNNN.pt``."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: ln.state() for name, ln in learners.items()}
    torch.save({"learners": state, "extra": extra or {}, "world": dist.get_world_size()},
               directory / f"rank_{dist.get_rank():05d}.pt")  # fmt: skip


def load_learners(directory: Path, learners: dict[str, FlowLearner]) -> dict:
    """Restore ``save_learners`` into ``learners``; returns ``extra``. The world size must match."""
    path = directory / f"rank_{dist.get_rank():05d}.pt"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no flow-model shard of rank {dist.get_rank()} (another layout?)")
    state = torch.load(path, weights_only=False)
    if state["world"] != dist.get_world_size():
        raise ValueError(f"{path}: saved by {state['world']} ranks, resumed on {dist.get_world_size()}")
    for name, ln in learners.items():
        ln.load(state["learners"][name])
    return state["extra"]
