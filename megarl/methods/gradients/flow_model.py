"""A tiny flow model for the flow-model RL methods (LC-GRPO, FlowCTS), in plain PyTorch.

Rectified flow: ``x_t = (1 − t) x_0 + t ε`` (t = 1 noise, t = 0 data) and a velocity MLP
``v_θ(x, t) ≈ E[ε − x_0 | x_t]`` over 2-D points with sinusoidal time features. The toy data is
a ring of 8 Gaussians; ``pretrain`` fits the velocity by flow matching. Samplers work on batches
[B, d]: the Euler ODE step, the LC step (Euler + one Langevin step at the new time) and
Flow-GRPO's SDE step, each returning its Gaussian transition (mean, variance); the per-step
log-likelihood is the closed-form Gaussian log-density.

This model is replicated on every rank and trained by the method's step hook with its own Adam:
it is not a Megatron model (no tensor/pipeline/expert parallelism).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

SAMPLERS = ("lc", "flow_grpo")


class VelocityMLP(nn.Module):
    """v_θ(x, t): an MLP over [x, sin/cos(2π f t)] (d -> d)."""

    def __init__(self, dim: int = 2, hidden: int = 64, layers: int = 3, freqs: int = 4):
        super().__init__()
        self.register_buffer("freqs", torch.arange(1, freqs + 1, dtype=torch.float32))
        width = [dim + 2 * freqs] + [hidden] * layers
        mods: list[nn.Module] = []
        for a, b in itertools.pairwise(width):
            mods += [nn.Linear(a, b), nn.SiLU()]
        self.net = nn.Sequential(*mods, nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
        """[B, d] velocities at times ``t`` (a float or [B])."""
        t = torch.as_tensor(t, dtype=x.dtype).expand(x.shape[0])
        ang = 2 * math.pi * t[:, None] * self.freqs.to(x.dtype)[None]
        return self.net(torch.cat([x, torch.sin(ang), torch.cos(ang)], -1))


def ring_data(n: int, gen: torch.Generator, modes: int = 8, radius: float = 2.0, std: float = 0.15):
    """[n, 2] samples of a ring of ``modes`` Gaussians."""
    k = torch.randint(0, modes, (n,), generator=gen)
    ang = 2 * math.pi * k.float() / modes
    centre = radius * torch.stack([torch.cos(ang), torch.sin(ang)], -1)
    return centre + std * torch.randn(n, 2, generator=gen)


def pretrain(model: VelocityMLP, steps: int, batch: int, lr: float, gen: torch.Generator) -> float:
    """Flow matching on ``ring_data``: ``‖v_θ(x_t, t) − (ε − x_0)‖²``; returns the last loss."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss = torch.zeros(())
    for _ in range(steps):
        x0 = ring_data(batch, gen)
        eps = torch.randn(batch, 2, generator=gen)
        t = torch.rand(batch, generator=gen)
        xt = (1 - t[:, None]) * x0 + t[:, None] * eps
        loss = ((model(xt, t) - (eps - x0)) ** 2).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def time_grid(steps: int) -> list[float]:
    """t_0 = 1 > t_1 > … > t_K = 0, uniform."""
    return [1.0 - k / steps for k in range(steps + 1)]


def score(x: torch.Tensor, t: float, v: torch.Tensor) -> torch.Tensor:
    """∇ log p_t(x) ≈ −(x + (1 − t) v) / t."""
    return -(x + (1.0 - t) * v) / t


def transition(model, x: torch.Tensor, t: float, s: float, sampler: str, a: float, exact: bool = True):
    """The Gaussian transition t -> s of ``sampler`` at randomness ``a``: (mean [B, d], variance).

    lc: Euler ``x̄ = x − Δ v(x, t)`` then Langevin at s with η = a·Δ: ``μ = x̄ + η S(x̄, s)``, var 2η
    (exact: S from v(x̄, s); cheap: from v(x, t)). flow_grpo: ``μ = x − Δ v + σ_t² Δ S(x, t) / 2``,
    var σ_t² Δ, σ_t² = a² t / max(1 − t, Δ). a = 0 or s = 0: the Euler step, variance 0."""
    dt = t - s
    vt = model(x, t)
    if a == 0.0 or s == 0.0:
        return x - dt * vt, 0.0
    if sampler == "lc":
        eta = a * dt
        xbar = x - dt * vt
        vs = model(xbar, s) if exact else vt
        return xbar + eta * score(xbar, s, vs), 2.0 * eta
    if sampler == "flow_grpo":
        sig2 = a * a * t / max(1.0 - t, dt)
        return x - dt * vt + 0.5 * sig2 * dt * score(x, t, vt), sig2 * dt
    raise ValueError(f"sampler={sampler!r}; known: {', '.join(SAMPLERS)}")


def gaussian_logprob(x: torch.Tensor, mean: torch.Tensor, var: float) -> torch.Tensor:
    """[B]: log N(x; mean, var·I) summed over the last dimension."""
    d = x.shape[-1]
    return -0.5 * d * math.log(2 * math.pi * var) - ((x - mean) ** 2).sum(-1) / (2 * var)


@torch.no_grad()
def sample(model, noise: torch.Tensor, steps: int, sampler: str, a: float, gen: torch.Generator,
           exact: bool = True):  # fmt: skip
    """Run the sampler from ``noise`` [B, d]: (trajectory [K + 1, B, d], per-step log-probs
    [S, B] of the stochastic steps, their step indices)."""
    times = time_grid(steps)
    xs, lps, idx = [noise], [], []
    for k in range(steps):
        mean, var = transition(model, xs[-1], times[k], times[k + 1], sampler, a, exact)
        if var > 0:
            x = mean + math.sqrt(var) * torch.randn(mean.shape, generator=gen, dtype=mean.dtype)
            lps.append(gaussian_logprob(x, mean, var))
            idx.append(k)
        else:
            x = mean
        xs.append(x)
    lp = torch.stack(lps) if lps else torch.zeros(0, noise.shape[0])
    return torch.stack(xs), lp, idx


def step_logprobs(model, traj: torch.Tensor, idx: list[int], steps: int, sampler: str, a: float,
                  exact: bool = True) -> torch.Tensor:  # fmt: skip
    """[S, B]: log p_θ(x_{k+1} | x_k) of the stored trajectory's stochastic steps ``idx`` (with grad)."""
    times = time_grid(steps)
    out = []
    for k in idx:
        mean, var = transition(model, traj[k], times[k], times[k + 1], sampler, a, exact)
        out.append(gaussian_logprob(traj[k + 1], mean, var))
    return torch.stack(out) if out else torch.zeros(0, traj.shape[1])
