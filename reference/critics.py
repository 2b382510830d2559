"""Critic (value) losses, padded [B, L] tensors with a response mask.

V are the critic's values now, V_old its values when the rollout was scored (the values GAE used),
R the value targets (GAE returns, V_old + A). Losses are token means over the masked-in tokens.
"""

import torch


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "clipped",
    clip: float = 0.2,
    huber_delta: float = 1.0,
) -> torch.Tensor:
    """Token-mean value loss.

    mse:      ½ (V - R)²
    clipped:  ½ max((V - R)², (V_old + clip(V - V_old, -ε, ε) - R)²)     (PPO's value clip)
    huber:    ½ x² if |x| <= δ else δ (|x| - ½ δ),  x = V - R
    Provenance: PPO (Schulman et al. 2017) and its reference implementations (value clipping);
    Huber (1964).
    values, old_values, returns, mask: [B, L] -> scalar
    """
    m = mask.to(values.dtype)
    err = values - returns
    if kind == "mse":
        per_token = 0.5 * err**2
    elif kind == "clipped":
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        per_token = 0.5 * torch.maximum(err**2, (clipped - returns) ** 2)
    elif kind == "huber":
        a = err.abs()
        per_token = torch.where(a <= huber_delta, 0.5 * err**2, huber_delta * (a - 0.5 * huber_delta))
    else:
        raise ValueError(f"unknown value loss {kind!r}")
    return (per_token * m).sum() / m.sum().clamp(min=1)


def bounded_values(raw: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Values squashed into the reward range: V = low + (high - low) · sigmoid(raw)."""
    return low + (high - low) * torch.sigmoid(raw)


def length_adaptive_lam(length: int, alpha: float) -> float:
    """BPCO's length-adaptive GAE λ for a response of ``length`` tokens: 1 − 1/(α·L), clamped to [0, 1].

    Below L = 1/α the formula turns negative (α = 0.4: L = 2 gives −0.25), which would flip the sign
    of the multi-step terms; the clamp makes such responses one-step TD (λ = 0).
    Provenance: BPCO, the authors' code (QPHutu/golden_critic, compute_lagae_advantage_return; the
    code as read does not clamp); the clamp is megarl's decision.
    """
    if length <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - 1.0 / (alpha * length)))


def lagae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    alpha: float = 0.4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BPCO's advantages and value targets: length-adaptive GAE and Monte Carlo returns.

    λ_i = length_adaptive_lam(L_i, α), L_i the number of response (masked-in) tokens of sequence i
    δ_t = r_t + γ V_{t+1} − V_t          (V after the last response token is 0)
    Â_t = δ_t + γ λ_i Â_{t+1}            (advantages, not whitened)
    R_t = Â^{λ=1}_t + V_t = Σ_k γ^k r_{t+k}   (value targets: the same recursion with λ = 1)
    Only masked-in tokens take part (t+1: the next response token of the same sequence).
    Provenance: BPCO (QPHutu/golden_critic, compute_lagae_advantage_return).
    token_rewards, values, mask: [B, L] -> (advantages [B, L], returns [B, L]), 0 off the mask
    """
    adv = torch.zeros_like(values)
    ret = torch.zeros_like(values)
    for b in range(mask.shape[0]):
        idx = mask[b].nonzero().flatten().tolist()
        lam = length_adaptive_lam(len(idx), alpha)
        next_v, next_a, next_a1 = 0.0, 0.0, 0.0
        for t in reversed(idx):
            delta = token_rewards[b, t] + gamma * next_v - values[b, t]
            next_a = delta + gamma * lam * next_a
            next_a1 = delta + gamma * next_a1
            adv[b, t] = next_a
            ret[b, t] = next_a1 + values[b, t]
            next_v = values[b, t]
    return adv, ret


# ---------------------------------------------------------------- CompPO / Comp-GAE / TAC
def attention_concentration(probs: torch.Tensor, statistic: str = "entropy") -> torch.Tensor:
    """Concentration κ of each query's attention distribution, averaged over heads.

    probs: [H, Q, K] attention probabilities of one sequence (row q covers keys 0..q, zeros after).
    entropy: κ_q = 1 − H(a_q)/log(n_q), n_q = q + 1 keys (κ = 1 for the first query, one key);
    max:     κ_q = max_j a_{q,j}.
    Provenance: reconstructed (CompPO names the statistic "attention concentration" only).
    -> [Q]
    """
    n = torch.arange(1, probs.shape[-1] + 1, dtype=torch.float64)[: probs.shape[1]]
    p = probs.double()
    if statistic == "max":
        return p.max(-1).values.mean(0)
    ent = -(p * torch.log(p.clamp(min=1e-300))).sum(-1)  # [H, Q]
    kappa = torch.where(n > 1, 1.0 - ent / torch.log(n.clamp(min=2.0)), torch.ones_like(ent))
    return kappa.mean(0)


def comp_gate(
    kappa: torch.Tensor,
    mask: torch.Tensor,
    g_min: float = 0.9,
    g_max: float = 1.0,
    slope: float = 1.0,
    offset: float = 0.0,
) -> torch.Tensor:
    """CompPO's retention gate g = g_min + (g_max − g_min)·σ(a·κ̃ + b), κ̃ = (κ − μ)/σ standardised
    over the batch's masked-in tokens (σ: unbiased std; κ̃ = 0 when all κ are equal). Detached.
    Provenance: reconstructed (the abstract says only "bounded, from the attention concentration").
    kappa, mask: [B, L] -> [B, L] (g_min + (g_max − g_min)·σ(b) off the mask, unused)
    """
    k = kappa.double().detach()
    sel = k[mask.bool()]
    if sel.numel() > 1 and float(sel.std()) > 0:
        z = (k - sel.mean()) / sel.std()
    else:
        z = torch.zeros_like(k)
    return g_min + (g_max - g_min) * torch.sigmoid(slope * z + offset)


def comp_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    gate: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Comp-GAE: GAE whose discount is gated per token, in the bootstrap and in the trace.

    δ_t = r_t + γ g_t V_{t+1} − V_t            (V after the last response token is 0)
    Â_t = Σ_{k≥0} (Π_{j<k} γ λ g_{t+j}) δ_{t+k}  (closed form, written as the sum here)
    value targets R_t = Â_t + V_t
    Only masked-in tokens take part (t+1: the next response token of the same sequence).
    Provenance: reconstructed from the CompPO abstract (gated bootstrap and trace; a constant gate
    is GAE with γ·g).
    token_rewards, values, gate, mask: [B, L] -> (advantages, returns) [B, L], 0 off the mask
    """
    adv = torch.zeros_like(values, dtype=torch.float64)
    for b in range(mask.shape[0]):
        idx = mask[b].nonzero().flatten().tolist()
        deltas = []
        for i, t in enumerate(idx):
            v_next = float(values[b, idx[i + 1]]) if i + 1 < len(idx) else 0.0
            deltas.append(
                float(token_rewards[b, t]) + gamma * float(gate[b, t]) * v_next - float(values[b, t])
            )
        for i, t in enumerate(idx):
            total, coef = 0.0, 1.0
            for k in range(i, len(idx)):
                total += coef * deltas[k]
                coef *= gamma * lam * float(gate[b, idx[k]])
            adv[b, t] = total
    mask64 = mask.double()
    return adv * mask64, (adv + values.double()) * mask64


# ---------------------------------------------------------------- SAPO
def action_spans(mask_row: torch.Tensor) -> list[tuple[int, int]]:
    """The actions (turns) of one sequence: maximal runs of masked-in tokens, as (first, last)
    positions. The state boundary of an action is ``first − 1`` (the last observation token)."""
    spans, start = [], None
    m = mask_row.bool().tolist()
    for t, on in enumerate(m + [False]):
        if on and start is None:
            start = t
        elif not on and start is not None:
            spans.append((start, t - 1))
            start = None
    return spans


def sapo_turn_gae(
    turn_rewards: list[list[float]], state_values: list[list[float]], gamma: float = 1.0, lam: float = 1.0
) -> tuple[list[list[float]], list[list[float]]]:
    """SAPO's trajectory-level GAE over turns, per trajectory.

    δ_t = r_t + γ V(s_{t+1}) − V(s_t)  (V after the last turn: 0);  A_t = Σ_l (γλ)^l δ_{t+l};
    λ-return targets G^λ_t = A_t + V(s_t). Returns (A, G^λ) per trajectory (not normalised).
    Provenance: reconstructed (SAPO's sources were not found).
    """
    advs, rets = [], []
    for r, v in zip(turn_rewards, state_values):
        n = len(r)
        delta = [r[t] + gamma * (v[t + 1] if t + 1 < n else 0.0) - v[t] for t in range(n)]
        a = [sum((gamma * lam) ** (k - t) * delta[k] for k in range(t, n)) for t in range(n)]
        advs.append(a)
        rets.append([a[t] + v[t] for t in range(n)])
    return advs, rets


def batch_normalise(values: list[list[float]], eps: float = 1e-8) -> list[list[float]]:
    """(x − mean)/(std + eps) over every entry of the batch (unbiased std; all equal: 0)."""
    flat = torch.tensor([x for row in values for x in row], dtype=torch.float64)
    if flat.numel() == 0 or bool(flat.max() == flat.min()):
        return [[0.0] * len(row) for row in values]
    std = float(flat.std()) if flat.numel() > 1 else 0.0
    mean = float(flat.mean())
    return [[(x - mean) / (std + eps) for x in row] for row in values]


def sapo_head_loss(
    v_state: list[torch.Tensor],
    q_action: list[torch.Tensor],
    turn_rewards: list[list[float]],
    targets: list[list[float]],
    gamma: float = 1.0,
    value_coef: float = 1.0,
    sarsa_coef: float = 1.0,
) -> torch.Tensor:
    """SAPO's value-head loss, means over the batch's turns:

    L_V = ½ (V(s_t) − sg G^λ_t)²
    L_Q = ½ (Q(s_t,a_t) − sg[r_t + γ Q(s_{t+1},a_{t+1})])²   (Q after termination: 0)
    loss = c_V L_V + c_Q L_Q
    v_state, q_action: per trajectory, [n_turns] tensors (differentiable).
    Provenance: reconstructed (on-policy SARSA; the spec's Σ over turns is a mean here).
    """
    lv = lq = torch.zeros((), dtype=torch.float64)
    n = 0
    for v, q, r, g in zip(v_state, q_action, turn_rewards, targets):
        for t in range(len(r)):
            q_next = q[t + 1].detach() if t + 1 < len(r) else torch.zeros((), dtype=q.dtype)
            lv = lv + 0.5 * (v[t] - g[t]) ** 2
            lq = lq + 0.5 * (q[t] - (r[t] + gamma * q_next)) ** 2
            n += 1
    n = max(n, 1)
    return value_coef * lv / n + sarsa_coef * lq / n


# ----------------------------------------------------------------------------- shared backbone
def policy_and_value_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    old_logp: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    value_coef: float,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    value_kind: str = "clipped",
    value_clip: float = 0.2,
    huber_delta: float = 1.0,
) -> torch.Tensor:
    """The shared-backbone actor-critic loss, one scalar for one backward:

    L = L_ppo(logits) + c_v · value_loss(V, V_old, R; value_kind)   (token means, response tokens)

    ``values`` [B, L] come from a value head on the same trunk as ``logits`` [B, L, V], so the
    gradient of the second term reaches the trunk. Provenance: PPO (Schulman et al. 2017), the
    shared-parameter objective L^{CLIP+VF} with the value coefficient c_1 (its entropy bonus is
    the objective's separate ``entropy_coef``).
    """
    from reference.loss import rl_loss

    pg = rl_loss(
        logits, tokens, mask, adv, old_logp, policy_loss="ppo", clip_low=clip_low, clip_high=clip_high
    )
    return pg + value_coef * value_loss(
        values, old_values, returns, mask, value_kind, value_clip, huber_delta
    )


# ---------------------------------------------------------------- SAO: prompt-level value
def prompt_value_advantage(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor):
    """SAO's prompt-level baseline (reconstructed: "A = R − V(x)", Monte Carlo value targets).

    G_t  = Σ_{k ≥ t} m_k r_k                 Monte Carlo return (γ = 1) over the loss tokens
    V(x) = values at the first loss token     the critic read where the prompt ends (values are
                                              aligned to the state before each token)
    A_t  = m_t (G_t − V(x)),  returns = m_t G_t   (the critic's regression target)
    With an outcome reward, A = R − V(x) on every response token.
    token_rewards, values, mask: [B, L] -> (A, returns) [B, L]
    """
    m = mask.to(torch.float64)
    r = token_rewards.to(torch.float64) * m
    G = torch.flip(torch.cumsum(torch.flip(r, [-1]), -1), [-1]) * m
    adv = torch.zeros_like(G)
    for b in range(m.shape[0]):
        on = torch.nonzero(m[b] > 0).flatten()
        if on.numel():
            adv[b] = (G[b] - values[b, on[0]].to(torch.float64)) * m[b]
    return adv, G
