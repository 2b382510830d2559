"""Parameter-space exploration in plain PyTorch: seeded Gaussian weight noise on whole HF tensors,
the ES update and gradient estimate, and 3PO's loss.

Noise: element i of HF tensor ``name`` under ``seed`` is a standard normal made from two 32-bit
words of a counter-based hash (MurmurHash3's finaliser, three rounds over the tensor's key, the
counter's low and high words and a lane) through Box-Muller in float64, rounded to float32. It is
a function of (seed, name, i) alone: any sharding of a tensor can regenerate its own elements.

ES (Salimans et al. 2017; as fine-tuning LLMs: Qiu et al. 2025, arXiv 2509.24372):
    θ ← θ + α/(M σ) Σ_m R̃_m ε_m,   ε_m = s_m ε(seed_m), s_m ∈ {+1, −1} (−1 only with antithetic pairs)
    R̃ = (R − mean R)/(std R + 1e-8) ("zscore", Qiu et al.), R − mean R ("center") or R ("none").
    ĝ = (1/(M σ)) Σ_m R̃_m ε_m estimates ∇_θ E_ε[J(θ + σε)], which equals ∇J on a quadratic.

3PO (reconstructed from the 3PO abstract and PSN-RLVR, arXiv 2602.02555): rollouts of step t come
from θ̃ = θ + σ ε(seed_t); the loss is GRPO's PPO-clip surrogate with the truncated importance
weight min(π_θold/π_θ̃, C) per token; σ = 0 is GRPO.
"""

import math
import zlib

import torch

from reference import aggregation, logprobs, policy_losses

M32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    # (a*c) mod 2^32 with 16-bit halves so int64 never overflows
    return ((a & 0xFFFF) * c + ((((a >> 16) * c) & 0xFFFF) << 16)) & M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _fmix(x: int) -> int:
    return int(_fmix32(torch.tensor(x & M32, dtype=torch.int64)))


def noise_key(seed: int, name: str) -> tuple[int, int]:
    """The two 32-bit key words of tensor ``name`` under ``seed``."""
    k0 = _fmix(zlib.crc32(name.encode()) ^ _fmix(seed & M32))
    k1 = _fmix(zlib.crc32(name.encode(), 0x9E3779B9) ^ _fmix((seed >> 32) ^ 0x7F4A7C15))
    return k0, k1


def hf_noise(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard-normal noise of the whole HF tensor ``name`` (float32, ``shape``)."""
    k0, k1 = noise_key(seed, name)
    i = torch.arange(math.prod(shape), dtype=torch.int64)
    words = []
    for lane in (0, 1):
        h = _fmix32((i & M32) ^ k0)
        h = _fmix32(h ^ (i >> 32) ^ k1)
        words.append(_fmix32(h ^ ((0x632BE5AB * (lane + 1)) & M32)))
    u1 = (words[0].double() + 0.5) / 2.0**32
    u2 = (words[1].double() + 0.5) / 2.0**32
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
    return z.float().reshape(shape)


def perturb_state(state: dict, seed: int, sigma: float) -> dict:
    """θ + σ ε(seed) for every HF tensor (computed in float32, stored in the tensor's dtype)."""
    return {n: (w.float() + sigma * hf_noise(seed, n, tuple(w.shape))).to(w.dtype) for n, w in state.items()}


def normalise_rewards(rewards: torch.Tensor, mode: str = "zscore") -> torch.Tensor:
    """R̃ of the population's rewards [M] (float64)."""
    r = rewards.double()
    if mode == "zscore":
        return (r - r.mean()) / (r.std(unbiased=False) + 1e-8)
    if mode == "center":
        return r - r.mean()
    if mode == "none":
        return r
    raise ValueError(f"unknown normalisation {mode!r}")


def es_gradient(
    thetas_noise: list[torch.Tensor],
    signs: list[float],
    rewards: torch.Tensor,
    sigma: float,
    mode: str = "zscore",
) -> torch.Tensor:
    """ĝ = (1/(Mσ)) Σ_m R̃_m s_m ε_m for one population (``thetas_noise[m]`` = ε(seed_m))."""
    rt = normalise_rewards(rewards, mode)
    g = torch.zeros_like(thetas_noise[0], dtype=torch.float64)
    for e, s, r in zip(thetas_noise, signs, rt):
        g += float(r) * s * e.double()
    return g / (len(signs) * sigma)


def es_update(
    state: dict,
    seeds: list[int],
    signs: list[float],
    rewards: torch.Tensor,
    sigma: float,
    lr: float,
    mode: str = "zscore",
) -> dict:
    """One ES step on HF tensors: θ + α/(Mσ) Σ_m R̃_m s_m ε(seed_m), the per-seed coefficients
    summed in float32 in first-appearance order of the seeds."""
    rt = normalise_rewards(rewards, mode)
    coef: dict[int, float] = {}
    for s, sign, r in zip(seeds, signs, rt.tolist()):
        coef[s] = coef.get(s, 0.0) + lr / (len(seeds) * sigma) * sign * r
    out = {}
    for n, w in state.items():
        delta = torch.zeros(w.shape, dtype=torch.float32)
        for s, c in coef.items():
            delta += float(c) * hf_noise(s, n, tuple(w.shape))
        out[n] = w + delta
    return out


def zero_advantage_fraction(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """The fraction of groups whose rewards are all equal (their GRPO advantages are 0)."""
    groups = torch.unique(group_ids)
    zero = sum(int(bool((rewards[group_ids == g] == rewards[group_ids == g][0]).all())) for g in groups)
    return zero / max(len(groups), 1)


def three_po_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    cap: float = 2.0,
    mode: str = "token-mean",
) -> torch.Tensor:
    """3PO loss (reconstructed): agg( PPO-clip(π_θ/π_θold, A) · min(π_θold/π_θ̃, C) ), padded
    [B, L] inputs (logits [B, L, V]); ``behaviour_logp`` = log π_θ̃ from the perturbed engine."""
    logp = logprobs.token_logprobs(logits, tokens)
    pg = policy_losses.ppo_clip(logp, old_logp, adv, clip_low, clip_high)
    w = torch.clamp(torch.exp(old_logp - behaviour_logp), max=cap).detach()
    return aggregation.aggregate(pg * w, mask, mode)
