"""Model, data and a single-process reference run of the launcher self-test (no signals, no process group)."""

from __future__ import annotations

import hashlib

import torch


def make_model() -> torch.nn.Module:
    """Tiny MLP, x: [B, 4] -> [B, 1], same initial weights everywhere."""
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum, so a resume that forgot the optimizer state gives different weights."""
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data of (step, rank): x [8, 4], y [8, 1] = 0.5 * sum(x)."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(8, 4, generator=g)
    return x, 0.5 * x.sum(dim=1, keepdim=True)


def digest(model: torch.nn.Module) -> str:
    """sha256 prefix of all parameters (bitwise identity of two runs)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def reference_digest(world_size: int, steps: int) -> str:
    """Digest after ``steps`` uninterrupted steps of a ``world_size``-rank run, computed in one process.

    Gradients are summed rank by rank and divided by the world size, as the all_reduce does; for two ranks the
    sum has one addition, so it is bitwise equal to gloo's.
    """
    model = make_model()
    opt = make_optimizer(model)
    for step in range(1, steps + 1):
        grads = None
        for rank in range(world_size):
            x, y = batch(step, rank)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            g = [p.grad.detach().clone() for p in model.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(model.parameters(), grads):
            p.grad = g / world_size
        opt.step()
    return digest(model)
