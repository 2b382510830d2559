"""A value head on the policy's own trunk (``inputs.values.model: trunk``): no second model.

Before the policy update the policy runs one forward-only pass with a hook on one of its layers
(``layer``; −1: the final norm) and keeps the hidden states h_p of every packed position,
detached (megarl/methods/critics/probe.py). A small MLP head (``head_width`` hidden units, tanh;
0: linear) maps them to values, aligned like the critic's: ``values[t] = head(h_{t−1})``, 0 on the
first token of each sequence. After the policy's optimizer steps the head takes ``epochs`` Adam
steps (its own learning rate ``lr``) toward the step's targets:

With ``router: true`` (an MoE policy) the features also hold every MoE layer's routing weights
at the position (TAC's φ(router): the top-k probabilities over the experts, 0 elsewhere).

- per token (default): the critic's value loss (``value_loss``: mse | clipped | huber) toward the
  estimator's returns or the Monte Carlo return (``targets``), a token mean over the loss tokens;
- at turn boundaries (``boundaries: true``): the actions of a sequence are its runs of loss
  tokens; V(s_t) = head(h at the last token before action t), Q(s_t, a_t) = head(h at its last
  token); loss = ½ mean_t (V(s_t) − sg G_t)² + sarsa_coef · ½ mean_t (Q_t − sg[r_t + γ Q_{t+1}])²
  (G_t: ``batch.returns`` on the action's first token; Q after the last action: 0).

No gradient reaches the trunk: the head sees ``sg(h)`` (CompPO's TAC design; SAPO's "gradient
stopping between the heads" reading). Every rank holds the whole batch's hidden states and
trains an identical replica of the head (same seed, same data): no communication. The head and
its Adam state go in the run checkpoints (``state_dict``).
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.value_losses import ValueObjective


class TrunkHead(torch.nn.Module):
    """hidden [N, H] -> values [N] (float32); the output layer starts at zero (V = 0)."""

    def __init__(self, hidden: int, width: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inner = None
        if width > 0:
            self.inner = torch.nn.Linear(hidden, width)
            with torch.no_grad():
                self.inner.weight.copy_(torch.randn(width, hidden, generator=g) / hidden**0.5)
                self.inner.bias.zero_()
        self.out = torch.nn.Linear(width if width > 0 else hidden, 1)
        with torch.no_grad():
            self.out.weight.zero_()
            self.out.bias.zero_()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Values of the hidden states ``h`` [N, H] -> [N]."""
        x = h.to(self.out.weight.dtype)
        if self.inner is not None:
            x = torch.tanh(self.inner(x))
        return self.out(x)[:, 0]


def aligned_values(head: TrunkHead, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``values[t] = head(hidden[t − 1])`` [T], 0 on the first token of every sequence."""
    raw = head(hidden)
    out = torch.cat([raw.new_zeros(1), raw[:-1]])
    first = torch.zeros_like(out, dtype=torch.bool)
    first[cu_seqlens[:-1]] = True
    return torch.where(first, torch.zeros_like(out), out)


def action_spans(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The actions of every sequence, runs of loss tokens, in batch order:
    (first [S], last [S], seq [S], span_of_token [T] with −1 off the loss mask)."""
    from megarl.ops.segments import token_to_seq

    m = batch.loss_mask.bool()
    T = m.numel()
    seq = token_to_seq(batch.cu_seqlens)
    is_first = torch.zeros(T, dtype=torch.bool)
    is_first[batch.cu_seqlens[:-1]] = True
    is_last = torch.zeros(T, dtype=torch.bool)
    is_last[batch.cu_seqlens[1:] - 1] = True
    prev_on = torch.cat([torch.zeros(1, dtype=torch.bool), m[:-1]]) & ~is_first
    next_on = torch.cat([m[1:], torch.zeros(1, dtype=torch.bool)]) & ~is_last
    starts = m & ~prev_on
    ends = m & ~next_on
    first = starts.nonzero().flatten()
    last = ends.nonzero().flatten()
    span = torch.full((T,), -1, dtype=torch.long)
    span[m] = (torch.cumsum(starts.long(), 0) - 1)[m]
    return first, last, seq[first], span


def turn_rewards(batch: PackedBatch, span: torch.Tensor, n_spans: int, rewards: torch.Tensor) -> torch.Tensor:
    """r_t per action [S]: the sum of the token rewards [T] over its tokens."""
    on = span >= 0
    return torch.zeros(n_spans, dtype=torch.float64).index_add(0, span[on], rewards[on].double())


def boundary_head_loss(
    head: TrunkHead,
    hidden: torch.Tensor,
    batch: PackedBatch,
    rewards: torch.Tensor,
    gamma: float,
    sarsa_coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The turn-boundary loss of the module docstring (means over the batch's actions) and its parts.
    hidden [T, H] detached; rewards [T] token rewards; targets G_t from ``batch.returns``."""
    first, last, seq, span = action_spans(batch)
    S = first.numel()
    if S == 0:
        zero = head(hidden[:1]).sum() * 0.0
        return zero, {"value_loss": 0.0, "sarsa_loss": 0.0}
    has_state = first > batch.cu_seqlens[seq]  # an action at a sequence's first token has no state token
    state_pos = (first - 1).clamp(min=0)
    v = head(hidden[state_pos]) * has_state.to(torch.float32)
    q = head(hidden[last])
    r = turn_rewards(batch, span, S, rewards).to(q.dtype)
    g_target = batch.returns[first].to(q.dtype).detach()
    same_seq_next = torch.zeros(S, dtype=torch.bool)
    same_seq_next[:-1] = seq[1:] == seq[:-1]
    q_next = torch.zeros_like(q)
    q_next[:-1] = q[1:].detach()
    q_next = torch.where(same_seq_next, q_next, torch.zeros_like(q_next))
    lv = 0.5 * ((v - g_target) ** 2 * has_state.to(q.dtype)).sum() / S
    lq = 0.5 * ((q - (r + gamma * q_next)) ** 2).sum() / S
    return lv + sarsa_coef * lq, {"value_loss": float(lv.detach()), "sarsa_loss": float(lq.detach())}


def feature_size(hf_config: dict, router: bool) -> int:
    """The head's input width: the hidden size, plus n_moe_layers · num_experts with ``router``."""
    if not router:
        return int(hf_config["hidden_size"])
    from megarl.learner.model import model_spec_from_hf

    spec = model_spec_from_hf(dict(hf_config))
    if not spec.is_moe:
        raise ValueError("inputs.values.router: true needs an MoE policy (this one has no router)")
    return spec.hidden_size + len(spec.moe_layers) * spec.num_experts


class TrunkCritic:
    """The ``values`` input on the policy's trunk; the same provider/hook interface as the critic."""

    def __init__(self, ctx: Any, knobs: Any):
        from megarl.methods.critics.critic import value_targets

        self._targets = value_targets
        self.ctx, self.knobs, self.policy = ctx, knobs, ctx.policy
        self.head = TrunkHead(
            feature_size(ctx.hf_config, knobs.router), knobs.head_width, ctx.cfg.model.seed + 1
        )
        self.optim = torch.optim.Adam(self.head.parameters(), lr=knobs.lr)
        self.objective = ValueObjective(knobs.value_loss, knobs.value_clip, knobs.huber_delta)
        self.gamma = float(ctx.cfg.advantage.knobs.get("gamma", 1.0))
        self.clip_grad = float(getattr(ctx.cfg.optimizer, "clip_grad", 0.0) or 0.0)
        self._batch: PackedBatch | None = None
        self._hidden: torch.Tensor | None = None
        self.needs_inputs: tuple[str, ...] = ()

    # ---------------------------------------------------------------- input provider
    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """``batch.values`` [T] from the head on the policy's hidden states (collective)."""
        from megarl.methods.critics.probe import hidden_states

        self._hidden = hidden_states(self.policy, batch, micro_batches, self.knobs.layer)
        if self.knobs.router:  # TAC's φ(router): the MoE routing weights beside the hidden states
            from megarl.methods.critics.probe import router_features

            self._hidden = torch.cat([self._hidden, router_features(self.policy, batch, micro_batches)], 1)
        with torch.no_grad():
            batch.values = aligned_values(self.head, self._hidden, batch.cu_seqlens).float()
        m = batch.loss_mask.bool()
        return {"critic/values_old": float(batch.values[m].mean()) if bool(m.any()) else 0.0}

    # ---------------------------------------------------------------- step hook
    def updates_policy(self, step: int) -> bool:
        """False during the head's warm-up (RL steps 1..warmup_steps)."""
        return step > self.knobs.warmup_steps

    def before_train(self, step: int, batch: PackedBatch) -> PackedBatch:
        """Keep the batch and its targets for the head's update; whiten advantages if asked."""
        from megarl.advantages.estimators import whiten

        if not self.knobs.boundaries:
            batch.returns = self._targets(batch, self.knobs.targets, self.gamma, self.knobs.lam)
        if batch.returns is None:
            raise ValueError(
                "inputs.values: the value head trains toward batch.returns, which this run's advantage "
                "estimator does not write (use an estimator that does, or inputs.values.targets: monte_carlo)"
            )
        if self.knobs.whiten_advantages:
            batch.advantages = whiten(batch.advantages, batch.loss_mask)
        self._batch = batch
        return batch

    def loss(self, batch: PackedBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The head's loss on the whole batch (differentiable in the head's parameters)."""
        if self.knobs.boundaries:
            from megarl.advantages.estimators import token_rewards

            return boundary_head_loss(
                self.head, hidden, batch, token_rewards(batch), self.gamma, self.knobs.sarsa_coef
            )
        v = aligned_values(self.head, hidden, batch.cu_seqlens)
        ctx = LossContext(normalisers=GlobalNormalisers.from_batch(batch))
        out = self.objective(v[:, None], batch, ctx)
        return out.loss, {"value_loss": float(out.loss.detach())}

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        """``epochs`` Adam steps of the head on the whole batch (identical on every rank)."""
        batch, hidden, self._batch = self._batch, self._hidden, None
        if batch is None or hidden is None:
            return {}
        parts: dict[str, float] = {}
        for _ in range(self.knobs.epochs):
            self.optim.zero_grad()
            loss, parts = self.loss(batch, hidden)
            loss.backward()
            if self.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.clip_grad)
            self.optim.step()
        res = {f"critic/{k}": v for k, v in parts.items()}
        if self.knobs.warmup_steps:
            res["critic/warmup"] = float(not self.updates_policy(step))
        return res

    def state_dict(self) -> dict:
        """The head's weights and its Adam state."""
        return {"head": self.head.state_dict(), "optim": self.optim.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict``."""
        self.head.load_state_dict(state["head"])
        self.optim.load_state_dict(state["optim"])
