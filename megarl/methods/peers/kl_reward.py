"""KL in the reward for any advantage estimator, with a fixed or adaptive coefficient, and two more
KL estimators (formulas: reference/peers.py).

- KL estimators ``abs`` (|logp − ref|) and ``k1_k2grad`` (k1's value, k2's gradient), usable as
  ``objective.kl_estimator`` and here.
- The advantage estimator ``kl_reward`` wraps another one (``base``): each sequence's reward
  becomes R − β Σ_t kl(old_t, ref_t); with dense token rewards each token's own β·kl_t comes off its
  reward. β comes from a controller kept in the estimator's state (checkpointed): ``fixed`` or
  ``adaptive`` (β ← β·(1 + clip(KL/target − 1, ±0.2)·B/horizon) after each batch).
"""

from __future__ import annotations

import dataclasses

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, scalar_rewards
from megarl.objectives.kl import KL_ESTIMATORS
from megarl.ops.segments import segment_sum
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|logp − ref_logp|; [T] -> [T]."""
    return (logp - ref_logp).abs()


def kl_k1_k2grad(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Value logp − ref, gradient (logp − ref)∇logp (straight-through); [T] -> [T]."""
    x = logp - ref_logp
    k2 = 0.5 * x**2
    return x.detach() + (k2 - k2.detach())


KL_ESTIMATORS.add("abs", kl_abs)
KL_ESTIMATORS.add("k1_k2grad", kl_k1_k2grad)

CONTROLLERS = ("fixed", "adaptive")


@dataclasses.dataclass
class KLController:
    """β of the KL in the reward; ``adaptive`` moves it toward ``target_kl`` over ``horizon`` sequences."""

    value: float
    kind: str = "fixed"
    target_kl: float = 0.1
    horizon: float = 10000.0
    last_kl: float = 0.0

    def update(self, current_kl: float, n_steps: int) -> None:
        """After a batch of ``n_steps`` sequences whose mean KL was ``current_kl``."""
        self.last_kl = current_kl
        if self.kind == "adaptive":
            err = min(max(current_kl / self.target_kl - 1, -0.2), 0.2)
            self.value *= 1 + err * n_steps / self.horizon

    def metrics(self) -> dict[str, float]:
        """β now and the KL of the last batch."""
        return {"kl_reward/coef": self.value, "kl_reward/kl": self.last_kl}

    def state_dict(self) -> dict:
        return {"value": self.value, "last_kl": self.last_kl}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.last_kl = float(state["value"]), float(state["last_kl"])


def _make_controller(
    *,
    kl_coef: float = 0.001,
    controller: str = "fixed",
    target_kl: float = 0.1,
    horizon: float = 10000.0,
    **_,
) -> KLController:
    if controller not in CONTROLLERS:
        raise ValueError(f"advantage.controller={controller!r}; allowed: {', '.join(CONTROLLERS)}")
    if controller == "adaptive" and not (horizon > 0 and target_kl > 0):
        raise ValueError(f"advantage.horizon={horizon!r} and target_kl={target_kl!r} must be > 0 (adaptive)")
    return KLController(float(kl_coef), controller, float(target_kl), float(horizon))


def _kl_reward(
    batch,
    state: KLController | None = None,
    base: str = "grpo",
    kl_coef: float = 0.001,
    kl_estimator: str = "k1",
    controller: str = "fixed",
    target_kl: float = 0.1,
    horizon: float = 10000.0,
) -> torch.Tensor:
    """``base``'s advantages on rewards with β·KL(π_old ‖ π_ref) taken off; [T]."""
    if base == "kl_reward":
        raise ValueError("advantage.base=kl_reward: the base must be another estimator")
    base_fn, info = ADVANTAGE_ESTIMATORS.get(base), ADVANTAGE_ESTIMATORS.info(base)
    if info.make_state is not None or info.batch_inputs:
        raise ValueError(
            f"advantage.base={base!r} keeps state or reads its own batch inputs; kl_reward wraps a "
            "stateless estimator of the rewards (grpo, dr_grpo, rloo, opo, gpg, ...)"
        )
    if batch.ref_logprobs is None:
        raise ValueError("advantage.estimator=kl_reward needs the batch field 'ref_logprobs'")
    old = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
    if old is None:
        raise ValueError("advantage.estimator=kl_reward needs 'old_logprobs' or 'rollout_logprobs'")
    state = state or _make_controller(
        kl_coef=kl_coef, controller=controller, target_kl=target_kl, horizon=horizon
    )
    m = batch.loss_mask.double()
    kl = KL_ESTIMATORS.get(kl_estimator)(old.double(), batch.ref_logprobs.double()) * m
    seq_kl = segment_sum(kl, batch.cu_seqlens)
    beta = state.value
    shaped = dataclasses.replace(batch, rewards=scalar_rewards(batch) - beta * seq_kl)
    if batch.token_rewards is not None:
        shaped.token_rewards = batch.token_rewards.double() - beta * kl
    adv = base_fn(shaped)
    if shaped.returns is not None:
        batch.returns = shaped.returns
    n = segment_sum(m, batch.cu_seqlens).clamp(min=1)
    state.update(float((seq_kl / n).mean()) if seq_kl.numel() else 0.0, batch.num_seqs)
    return adv


ADVANTAGE_ESTIMATORS.add(
    "kl_reward", _kl_reward, PartInfo(batch_inputs=("ref_logprobs",), make_state=_make_controller)
)

SPEC = MethodSpec(
    name="kl_reward",
    summary="KL in the reward (fixed or adaptive coefficient) for any advantage estimator",
    provenance="code",
    config={"advantage": {"estimator": "kl_reward"}},
)
