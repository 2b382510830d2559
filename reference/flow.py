"""Flow-model RL in plain PyTorch loops, written for reading (LC-GRPO, Flow-GRPO's SDE, FlowCTS).

Convention (rectified flow): ``x_t = (1 − t) x_0 + t ε``, t = 1 is noise, t = 0 data; a velocity
field ``v(x, t) ≈ E[ε − x_0 | x_t = x]``; sampling runs t from 1 down to 0. ``v`` is any callable
``v(x [d], t float) -> [d]`` here (one sample at a time).

LC-GRPO and FlowCTS are RECONSTRUCTED from their abstracts (the formulas are ours); Flow-GRPO's
SDE step follows the Flow-GRPO paper (Liu et al. 2025, arXiv 2505.05470) as recalled, with the
noise scale σ_t = a·sqrt(t / (1 − t)) and 1 − t floored at the step size.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

Field = Callable[[torch.Tensor, float], torch.Tensor]


# ------------------------------------------------------------------------------------ shared
def score_from_velocity(x: torch.Tensor, t: float, v: torch.Tensor) -> torch.Tensor:
    """∇ log p_t(x) ≈ −(x + (1 − t) v) / t  (ε̂ = x + (1 − t) v, score = −ε̂ / t)."""
    return -(x + (1.0 - t) * v) / t


def gaussian_logprob(x: torch.Tensor, mean: torch.Tensor, var: float) -> torch.Tensor:
    """log N(x; mean, var·I), summed over the dimensions, one term at a time."""
    total = torch.zeros((), dtype=x.dtype)
    for i in range(x.numel()):
        total = total - 0.5 * math.log(2 * math.pi * var) - (x[i] - mean[i]) ** 2 / (2 * var)
    return total


# ------------------------------------------------------------------------------------ LC-GRPO
def lc_transition(v: Field, x: torch.Tensor, t: float, s: float, eta: float, exact: bool = True):
    """One LC step t -> s (RECONSTRUCTED): Euler ``x̄ = x − (t − s) v(x, t)``, then a Langevin step at
    s: mean ``μ = x̄ + η S(x̄, s)`` (exact: S from v(x̄, s), 2 NFEs; cheap: from v(x, t)), variance
    2η. Returns (μ, var); η = 0 or s = 0 is the plain Euler step (variance 0)."""
    vt = v(x, t)
    xbar = x - (t - s) * vt
    if eta == 0.0 or s == 0.0:
        return xbar, 0.0
    vs = v(xbar, s) if exact else vt
    return xbar + eta * score_from_velocity(xbar, s, vs), 2.0 * eta


def flow_grpo_transition(v: Field, x: torch.Tensor, t: float, s: float, a: float):
    """Flow-GRPO's SDE step t -> s: ``μ = x − Δ v + (σ_t² Δ / 2) S(x, t)``, variance σ_t² Δ, with
    σ_t² = a² t / max(1 − t, Δ). The last step (s = 0) is the Euler step (variance 0)."""
    dt = t - s
    vt = v(x, t)
    if a == 0.0 or s == 0.0:
        return x - dt * vt, 0.0
    sig2 = a * a * t / max(1.0 - t, dt)
    return x - dt * vt + 0.5 * sig2 * dt * score_from_velocity(x, t, vt), sig2 * dt


def sde_step_logprobs(
    v: Field, xs: list[torch.Tensor], times: list[float], knob: float, sampler: str, exact: bool = True
) -> list[torch.Tensor]:
    """Per-step log p(x_{k+1} | x_k) along one stored trajectory ``xs`` [K + 1] on ``times`` (the
    stochastic steps only: variance > 0)."""
    out = []
    for k in range(len(times) - 1):
        if sampler == "lc":
            mean, var = lc_transition(
                v, xs[k], times[k], times[k + 1], knob * (times[k] - times[k + 1]), exact
            )
        else:
            mean, var = flow_grpo_transition(v, xs[k], times[k], times[k + 1], knob)
        if var > 0:
            out.append(gaussian_logprob(xs[k + 1], mean, var))
    return out


def grpo_step_loss(
    new: list[list[torch.Tensor]], old: list[list[float]], adv: list[float], clip: float
) -> torch.Tensor:
    """Per-step PPO-clip with the sample's group advantage broadcast to every step, averaged over
    all (sample, step) terms: ``−mean min(r A, clip(r, 1 − ε, 1 + ε) A)``, r = exp(new − old)."""
    terms = []
    for i in range(len(new)):
        for k in range(len(new[i])):
            r = torch.exp(new[i][k] - old[i][k])
            terms.append(-torch.minimum(r * adv[i], torch.clamp(r, 1 - clip, 1 + clip) * adv[i]))
    return torch.stack(terms).sum() / len(terms)


def group_advantages(rewards: list[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """GRPO advantage within consecutive groups of ``group_size`` samples (std unbiased)."""
    out = []
    for g in range(0, len(rewards), group_size):
        r = torch.tensor(rewards[g : g + group_size], dtype=torch.float64)
        sd = float(r.std()) if len(r) > 1 else 0.0
        out += [0.0 if sd == 0 else float((x - r.mean()) / (sd + eps)) for x in r]
    return out


# ------------------------------------------------------------------------------------ FlowCTS
def cts_weight(u: float, t_k: float) -> float:
    """w(u) = ∫_u^1 (s − t_k) ds = ½[(1 − t_k)² − (u − t_k)²]  (FlowCTS time τ: 0 noise, 1 data)."""
    return 0.5 * ((1.0 - t_k) ** 2 - (u - t_k) ** 2)


def flowcts_loss(f_s: Field, f_r: Field, x: torch.Tensor, t_k: float, n: int, own_paths: bool = True):
    """L_N (RECONSTRUCTED) for one start state x at FlowCTS time t_k (τ: 0 noise -> 1 data; fields
    are dx/dτ): N Euler steps of h = (1 − t_k)/N; the student on its own path, the reference on its
    own path from the same start (``own_paths``) or at the student's point (no gradient through the
    reference):
    ``Σ_j w(u_j) ‖f_S(x^S_j, u_j) − f_R(x̂_j, u_j)‖² h``."""
    h = (1.0 - t_k) / n
    xs, xr, total = x, x, torch.zeros((), dtype=x.dtype)
    for j in range(n):
        u = t_k + j * h
        fs = f_s(xs, u)
        fr = f_r(xr if own_paths else xs, u).detach()  # the reference is a fixed target
        total = total + cts_weight(u, t_k) * ((fs - fr) ** 2).sum() * h
        xs = xs + h * fs
        xr = xr + h * fr if own_paths else xs
    return total


def trajectory_discrepancy(f_s: Field, f_r: Field, x: torch.Tensor, t_k: float, n: int) -> torch.Tensor:
    """Σ_{j=0}^{N−1} h ‖x^S_j − x^R_j‖²: each field's own Euler path from the same start (the left
    side of the discrete FlowCTS bound, ≤ ``flowcts_loss(own_paths=True)``)."""
    h = (1.0 - t_k) / n
    xs, xr, total = x, x, torch.zeros((), dtype=x.dtype)
    for j in range(n):
        u = t_k + j * h
        total = total + h * ((xs - xr) ** 2).sum()
        xs, xr = xs + h * f_s(xs, u), xr + h * f_r(xr, u)
    return total


def kl_opd_loss(f_s: Field, f_r: Field, x: torch.Tensor, t_k: float, n: int, a: float) -> torch.Tensor:
    """Vanilla KL on-policy distillation for flows (the FlowCTS baseline): along the student's own
    path, the KL between the two auxiliary SDE transition Gaussians of each step,
    ``h² ‖f_S − f_R‖² / (2 σ²)`` with σ² = a² h (1 − u)/max(u, h) (Flow-GRPO's σ_t at t = 1 − u)."""
    h = (1.0 - t_k) / n
    xs, total = x, torch.zeros((), dtype=x.dtype)
    for j in range(n):
        u = t_k + j * h
        fs = f_s(xs, u)
        fr = f_r(xs, u).detach()
        sig2 = a * a * h * (1.0 - u) / max(u, h)
        total = total + h * h * ((fs - fr) ** 2).sum() / (2 * sig2)
        xs = xs + h * fs
    return total


# ------------------------------------------------------------------------------------ flow DiT
def _rms(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps) * w


def _dit_mlp(w: dict, p: str, m: torch.Tensor, experts: int, topk: int) -> torch.Tensor:
    """The layer's MLP on [..., H]: silu(m W1ᵀ) W2ᵀ, or a Mixture of Experts: the router's top-k
    logits, softmax over those k, the chosen experts' MLPs weighted by it (no capacity, no drops)."""
    if not experts:
        return F.silu(m @ w[p + "linear_fc1.weight"].T) @ w[p + "linear_fc2.weight"].T
    logits = m @ w[p + "router.weight"].T
    top, idx = torch.topk(logits, topk, dim=-1)
    probs = torch.softmax(top, -1)
    out = torch.zeros_like(m)
    for e in range(experts):
        q = f"{p}experts.local_experts.{e}."
        y = F.silu(m @ w[q + "linear_fc1.weight"].T) @ w[q + "linear_fc2.weight"].T
        out = out + ((idx == e).to(m.dtype) * probs).sum(-1, keepdim=True) * y
    return out


def dit_velocity(w: dict, x: torch.Tensor, t, *, patch: int, heads: int, layers: int, freqs: int,
                 experts: int = 0, topk: int = 2, eps: float = 1e-6) -> torch.Tensor:  # fmt: skip
    """The tiny flow DiT in plain PyTorch, on full weights ``w`` named like the Megatron model's
    parameters (megarl.learner.flow_dit): points ``x`` [B, dim] cut into dim/patch tokens,
    token = W_in·patch + pos + W_2 SiLU(W_1 [sin, cos](2π f t)); per layer pre-RMSNorm
    bidirectional multi-head attention (fused QKV weight laid out per head as [q; k; v]) and a
    pre-RMSNorm MLP, each added to the residual; final RMSNorm; W_out back to the patch values."""
    B, dim = x.shape
    n = dim // patch
    t = torch.as_tensor(t, dtype=x.dtype).expand(B)
    ang = 2 * math.pi * t[:, None] * torch.arange(1, freqs + 1, dtype=x.dtype)[None]
    feats = torch.cat([torch.sin(ang), torch.cos(ang)], -1)
    temb = F.silu(feats @ w["time_in.weight"].T + w["time_in.bias"]) @ w["time_out.weight"].T
    temb = temb + w["time_out.bias"]
    h = x.reshape(B, n, patch) @ w["patch_in.weight"].T + w["patch_in.bias"] + w["pos"][None] + temb[:, None]
    H = h.shape[-1]
    hd = H // heads
    for layer in range(layers):
        p = f"block.layers.{layer}."
        a = _rms(h, w[p + "input_layernorm.weight"], eps)
        q, k, v = (a @ w[p + "self_attention.linear_qkv.weight"].T).reshape(B, n, heads, 3, hd).unbind(3)
        probs = torch.softmax(torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(hd), -1)
        ctx = torch.einsum("bhij,bjhd->bihd", probs, v).reshape(B, n, H)
        h = h + ctx @ w[p + "self_attention.linear_proj.weight"].T
        h = h + _dit_mlp(w, p + "mlp.", _rms(h, w[p + "pre_mlp_layernorm.weight"], eps), experts, topk)
    h = _rms(h, w["block.final_layernorm.weight"], eps)
    return (h @ w["head.weight"].T + w["head.bias"]).reshape(B, dim)
