"""KL-to-reference estimators on sampled-token log-probs, registered by name (formulas: reference/kl.py)."""

from __future__ import annotations

import torch

from megarl.registry import Registry

KL_ESTIMATORS: Registry = Registry("kl_estimator")


@KL_ESTIMATORS.register("k1")
def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    x = ref_logp - logp
    return torch.expm1(x) - x


@KL_ESTIMATORS.register("k3_k2grad")
def k3_value_k2_grad(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    g = k2(logp, ref_logp)
    return k3(logp, ref_logp).detach() + (g - g.detach())
