"""OPDVR and GRPD: the sampled-token OPD reward gated by the verifier (formula:
reference/distillation.py ``opdvr_rewards``, ``grpd_rewards``). From the authors' README and run
scripts (their gate code was not readable).

    OPDVR  r_t = max(0, ℓ_t) on a correct trajectory, min(0, ℓ_t) on an incorrect one
           (gate=inverse swaps the kept sides; gate=off is plain OPD, r_t = ℓ_t); A_t = r_t
    GRPD   A_t = r_t · (|A_i| + u),  A_i = R_i − mean_group R (Dr.GRPO; ÷ std with scale_by_std)
"""

from __future__ import annotations

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo, scalar_rewards
from megarl.batch import PackedBatch
from megarl.methods.distillation.opd_signal import Diagnostics, correct, opd_reward, token_mean
from megarl.ops.segments import broadcast_to_tokens
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

GATES = ("correctness", "inverse", "off")


def gate_rewards(
    ell: torch.Tensor, cu_seqlens: torch.Tensor, is_correct: torch.Tensor, gate: str
) -> torch.Tensor:
    """The gated token rewards [T] from ``ell`` [T] and the verdicts [B] (see the module docstring)."""
    if gate not in GATES:
        raise ValueError(f"advantage.gate={gate!r}; allowed: {', '.join(GATES)}")
    if gate == "off":
        return ell
    ok = broadcast_to_tokens(is_correct, cu_seqlens)
    if gate == "inverse":
        ok = ~ok
    return torch.where(ok, ell.clamp(min=0), ell.clamp(max=0))


def _report(state: Diagnostics | None, name: str, ell, r, m) -> None:
    if state is not None:
        state.last = {
            f"{name}/reward_mean": token_mean(ell, m),
            f"{name}/gated_mean": token_mean(r, m),
            f"{name}/zeroed_frac": token_mean(((r == 0) & (ell != 0)).double(), m),
        }


def opdvr(
    batch: PackedBatch, gate: str = "correctness", threshold: float = 0.0, state: Diagnostics | None = None
) -> torch.Tensor:
    """A_t = gated ℓ_t on the loss tokens (no return accumulation); [T]."""
    ell = opd_reward(batch, "advantage.estimator=opdvr")
    r = gate_rewards(ell, batch.cu_seqlens, correct(batch, threshold), gate)
    _report(state, "opdvr", ell, r, batch.loss_mask)
    return r


def grpd(
    batch: PackedBatch,
    gate: str = "correctness",
    threshold: float = 0.0,
    scale_by_std: bool = False,
    baseline: float = 0.0,
    eps: float = 1e-6,
    state: Diagnostics | None = None,
) -> torch.Tensor:
    """A_t = gated ℓ_t · (|A_i| + baseline); [T]."""
    if not baseline >= 0:
        raise ValueError(f"advantage.baseline={baseline!r} must be >= 0")
    ell = opd_reward(batch, "advantage.estimator=grpd")
    r = gate_rewards(ell, batch.cu_seqlens, correct(batch, threshold), gate)
    scale = grpo(scalar_rewards(batch), batch.group_ids, scale_by_std, eps).abs() + baseline
    out = r * broadcast_to_tokens(scale, batch.cu_seqlens)
    _report(state, "grpd", ell, out, batch.loss_mask)
    return out


ADVANTAGE_ESTIMATORS.add("opdvr", opdvr, PartInfo(batch_inputs=("teacher_logprobs",), make_state=Diagnostics))
ADVANTAGE_ESTIMATORS.add(
    "grpd",
    grpd,
    PartInfo(batch_inputs=("teacher_logprobs",), make_state=Diagnostics, group_relative=True),
)

_OBJECTIVE = {
    "policy_loss": "ppo",
    "clip_low": 0.2,
    "clip_high": 0.2,
    "aggregation": "token-mean",
    "kl_coef": 0.0,
}

OPDVR = MethodSpec(
    name="opdvr",
    summary="OPDVR: the OPD token reward kept only on the side the verifier's verdict allows",
    provenance="paper",
    config={"advantage": {"estimator": "opdvr"}, "objective": dict(_OBJECTIVE)},
)

GRPD = MethodSpec(
    name="grpd",
    summary="GRPD: OPDVR's gated token reward scaled by |group advantage| + u",
    provenance="paper",
    config={"advantage": {"estimator": "grpd"}, "objective": dict(_OBJECTIVE)},
)
