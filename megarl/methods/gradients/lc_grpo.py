"""LC-GRPO: GRPO over the denoising steps of a flow model with Langevin-corrected transitions
(reconstructed), on a tiny flow model: the plain-PyTorch velocity MLP of
megarl/methods/gradients/flow_model.py (``model: mlp``) or the DiT on megatron-core of
megarl/learner/flow_dit.py (``model: megatron``: TP-sharded, MoE with EP, megatron's optimizer).

Each stochastic step t -> s is an inference-aligned Euler step followed by one Langevin step at s
with the score derived from the velocity, ``S(x, s) = −(x + (1 − s) v_θ(x, s)) / s``:

    x̄ = x_t − Δ v_θ(x_t, t),   x_s = x̄ + η S_θ(x̄, s) + sqrt(2η) ξ,   η = a·Δ

so ``log p_θ(x_s | x_t) = log N(x_s; x̄ + η S_θ(x̄, s), 2η I)`` (exact: S from v_θ(x̄, s), 2 NFEs;
cheap: from v_θ(x_t, t)). The last step (s = 0) is the plain Euler step. Per RL step the method
samples ``groups`` × ``group_size`` trajectories with the current model, rewards the final points
(a Gaussian bump around ``target``), takes the GRPO advantage within each group, broadcasts it to
every stochastic step, and minimises the per-step PPO-clip loss ``−mean_{i,k} min(r A, clip(r) A)``
(r = exp(log p_θ − log p_old)) for ``updates`` Adam steps. ``sampler: flow_grpo`` swaps in
Flow-GRPO's SDE step (the baseline); a = 0 is the deterministic Euler ODE.

Runs in the RL loop as a step hook that is a ``PolicyGate``: the run's language-model policy is
held still (its rollouts still run and are logged, unused), and the flow model is trained with its
own Adam (flow_run.py: every rank samples the same trajectories; with the Megatron model each
data-parallel replica computes its share of the loss); its weights and optimizer state go in
every checkpoint.

Provenance: reconstructed from the LC-GRPO abstract (ODE Euler step + Langevin correction with
the velocity-derived score; Gaussian transition likelihood; narrower SDE-rollout / ODE-inference
gap); the score formula, η = a·Δ and the reward are our choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megarl.methods.gradients import flow_model as fm
from megarl.methods.gradients.flow_megatron import ShardedFlow
from megarl.methods.gradients.flow_run import FlowHook, FlowKnobs, as_flow, make_flow
from megarl.plugin.spec import MethodParts, MethodSpec


@dataclass
class LCGRPOKnobs(FlowKnobs):
    """sampler: lc | flow_grpo; a: the randomness level (η = a·Δ for lc, σ_t's scale for
    flow_grpo); exact: the score at (x̄, s) (2 NFEs) or from v(x_t, t); groups, group_size;
    clip: ε of the PPO clip; updates: Adam steps per RL step; target, width: the reward
    ``exp(−‖x − target‖² / (2 width²))``."""

    sampler: str = "lc"
    a: float = 0.3
    exact: bool = True
    groups: int = 8
    group_size: int = 8
    clip: float = 0.2
    updates: int = 2
    target: list = field(default_factory=lambda: [2.0, 0.0])
    width: float = 0.5

    def check(self) -> None:
        """Ranges and names."""
        super().check()
        if self.sampler not in fm.SAMPLERS:
            raise ValueError(f"method.sampler={self.sampler!r}; known: {', '.join(fm.SAMPLERS)}")
        if self.a < 0 or self.clip <= 0 or self.width <= 0:
            raise ValueError("method.a >= 0, method.clip > 0 and method.width > 0")
        if self.groups < 1 or self.group_size < 2 or self.updates < 1:
            raise ValueError("method.groups >= 1, method.group_size >= 2 and method.updates >= 1")
        if len(self.target) != 2:
            raise ValueError(f"method.target={self.target} must be a 2-D point")


def bump_reward(x: torch.Tensor, target: list, width: float) -> torch.Tensor:
    """[B]: exp(−‖x − target‖² / (2 width²))."""
    c = torch.tensor(target, dtype=x.dtype)
    return torch.exp(-((x - c) ** 2).sum(-1) / (2 * width * width))


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """[B]: GRPO advantage within consecutive groups (std unbiased; equal rewards: 0)."""
    r = rewards.reshape(-1, group_size)
    sd = r.std(-1, keepdim=True)
    adv = (r - r.mean(-1, keepdim=True)) / (sd + eps)
    return torch.where(sd > 0, adv, torch.zeros_like(adv)).reshape(-1)


def step_loss(new: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, clip: float,
              count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-step PPO-clip over [S, B] log-probs with the advantages [B] broadcast to the steps:
    ``−Σ min(r A, clip(r, 1−ε, 1+ε) A) / count`` (count: all terms of the whole batch, so that
    micro-batches add up to the whole batch's loss). Returns (loss, clipped fraction)."""
    r = torch.exp(new - old)
    a = adv[None].to(new.dtype)
    terms = -torch.minimum(r * a, torch.clamp(r, 1 - clip, 1 + clip) * a)
    n = count if count is not None else terms.numel()
    clipped = ((r - 1).abs() > clip).to(new.dtype).mean()
    return terms.sum() / n, clipped


class LCGRPOHook(FlowHook):
    """One LC-GRPO step per RL step; see the module docstring. ``model``: a velocity module or a
    flow learner to train (else the one the knobs name, built under ``ctx``'s groups)."""

    def __init__(self, knobs: LCGRPOKnobs, model=None, ctx=None):
        if model is None:
            model = make_flow(knobs, ctx, knobs.seed, knobs.pretrain_steps)
        super().__init__(as_flow(model, knobs.lr))
        self.knobs = knobs

    def rollouts(self, step: int) -> dict:
        """The step's SDE trajectories, their old log-probs, rewards, advantages; the ODE rewards
        from the same noise (the same on every rank)."""
        k = self.knobs
        gen = torch.Generator().manual_seed(k.seed * 1_000_003 + step)
        noise = torch.randn(k.groups * k.group_size, 2, generator=gen)
        traj, old, idx = fm.sample(self.model, noise, k.steps, k.sampler, k.a, gen, k.exact)
        ode = fm.sample(self.model, noise, k.steps, k.sampler, 0.0, gen)[0][-1]
        r = bump_reward(traj[-1], k.target, k.width)
        return {
            "traj": traj, "old": old, "idx": idx, "rewards": r,
            "adv": group_advantages(r, k.group_size), "ode_rewards": bump_reward(ode, k.target, k.width),
        }  # fmt: skip

    def share_loss(self, ro: dict, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-step PPO-clip loss of the samples ``part``, normalised by the whole batch's term
        count (the replicas' shares add up to the whole loss), and their clipped count / that count."""
        k = self.knobs
        new = fm.step_logprobs(self.model, ro["traj"][:, part], ro["idx"], k.steps, k.sampler, k.a, k.exact)
        count = ro["old"].numel()
        loss, clipped = step_loss(new, ro["old"][:, part], ro["adv"][part], k.clip, count=count)
        return loss, clipped * new.numel() / count

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        """Rollouts, then ``updates`` Adam steps on the per-step PPO-clip loss."""
        k, ro = self.knobs, self.rollouts(step)
        before = self.flow.flat()
        micro = self.flow.micro_batches(self.flow.dp_share(ro["traj"].shape[1]), k.micro_batches)
        loss, clipped = 0.0, torch.zeros(())
        for _ in range(k.updates):
            out: list = []

            def share(chunk: torch.Tensor, out=out) -> torch.Tensor:
                value, frac = self.share_loss(ro, chunk)
                out.append(frac)
                return value

            loss, _ = self.flow.train_step([lambda c=c: share(c) for c in micro])
            clipped = sum(out[1:], out[0])
        self.updates += 1
        sde, ode = float(ro["rewards"].mean()), float(ro["ode_rewards"].mean())
        return {
            "lc_grpo/reward_sde": sde,
            "lc_grpo/reward_ode": ode,
            "lc_grpo/sde_ode_gap": abs(sde - ode),
            "lc_grpo/loss": loss,
            "lc_grpo/clip_frac": self.flow.all_reduce_dp(clipped),
            "lc_grpo/update_norm": float((self.flow.flat() - before).norm()),
            "lc_grpo/stochastic_steps": float(len(ro["idx"])),
            **self.flow_metrics("lc_grpo"),
        }


class ShardedLCGRPOHook(ShardedFlow, LCGRPOHook):
    """LC-GRPO on the Megatron flow model: its shards saved per rank in every checkpoint."""


def build(ctx, knobs: LCGRPOKnobs) -> MethodParts:
    """The LC-GRPO step hook on every rank (its flow model under the run's groups)."""
    cls = ShardedLCGRPOHook if knobs.model == "megatron" else LCGRPOHook
    return MethodParts(step_hooks=[cls(knobs, ctx=ctx)])


SPEC = MethodSpec(
    name="lc-grpo",
    summary="flow-model GRPO over denoising steps with Euler + Langevin-corrected Gaussian transitions",
    provenance="reconstructed",
    knobs=LCGRPOKnobs,
    build=build,
)
