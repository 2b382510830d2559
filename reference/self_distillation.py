"""Self-distillation methods (the teacher is the policy itself reading a privileged context), on the
padded layout [B, L] with full logits [B, L, V]. Plain PyTorch, written from the formulas.

Notation: logp = log π_θ(y_t | x, y_<t) (current), old_logp the behaviour policy's, teacher_logp =
log π_θ(y_t | x, c, y_<t) under the privileged context c (stop-gradient), mask the loss tokens,
groups the prompt of each sequence.

I-SDPO (reconstructed from the abstract; the distillation term follows SDPO's sampled-token form):
  route(x) = distil  if no sample of the group is correct, else grpo
  L = Σ_{grpo tokens} ppo_clip(r_t, A_i) / N_grpo + λ_SD Σ_{distil tokens} sd_t / N_distil
  sd_t = -sg(teacher_logp - old_logp) · exp(logp - sg(old_logp))   (sampled-token reverse KL)
  N_route: the route's loss-token count (token-mean) or its sequence count (seq-mean-*, with the
  per-sequence token mean inside for seq-mean-token-mean).
  Full-vocabulary variant (SDPO's full_logits): sd_t = KL(π_T(·|x, c, y_<t) ‖ π_θ(·|x, y_<t)).
"""

import torch


def _logp(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[b, t]) from logits[b, t] (aligned: logits[t] scored tokens[t])."""
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]


def ppo_clip(logp, old_logp, adv, clip_low: float, clip_high: float) -> torch.Tensor:
    """-min(r A, clip(r, 1 - low, 1 + high) A) per token."""
    r = torch.exp(logp - old_logp)
    return -torch.minimum(r * adv, torch.clamp(r, 1 - clip_low, 1 + clip_high) * adv)


def sampled_reverse_kl(logp, old_logp, teacher_logp) -> torch.Tensor:
    """The sampled-token reverse-KL distillation loss per token (see the module docstring)."""
    return -(teacher_logp - old_logp).detach() * torch.exp(logp - old_logp.detach())


def route_mean(loss: torch.Tensor, mask: torch.Tensor, on: torch.Tensor, aggregation: str) -> torch.Tensor:
    """The aggregate of ``loss`` [B, L] over the sequences ``on`` [B] alone (0 when none has a loss token)."""
    m = mask * on[:, None].to(mask.dtype)
    n_tok = m.sum(1)
    if aggregation == "token-mean":
        return (loss * m).sum() / m.sum().clamp(min=1)
    n_seq = (n_tok > 0).sum().clamp(min=1)
    if aggregation == "seq-mean-token-mean":
        return ((loss * m).sum(1) / n_tok.clamp(min=1)).sum() / n_seq
    if aggregation == "seq-mean-token-sum":
        return (loss * m).sum() / n_seq
    raise ValueError(f"aggregation {aggregation!r} is not supported here")


def isdpo_routes(correct: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[B] bool: True where the sequence's group has no correct sample (the distil route)."""
    out = torch.zeros_like(correct, dtype=torch.bool)
    for g in torch.unique(group_ids):
        sel = group_ids == g
        out[sel] = not bool(correct[sel].any())
    return out


def isdpo_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    old_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    teacher_on: torch.Tensor,
    correct: torch.Tensor,
    group_ids: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    sd_coef: float = 1.0,
    aggregation: str = "token-mean",
    teacher_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """I-SDPO loss (module docstring). logits [B, L, V]; tokens, mask, adv, old_logp, teacher_logp
    [B, L]; teacher_on [B] (sequences the self-teacher scored), correct [B], group_ids [B].
    With ``teacher_logits`` [B, L, V] the distil route's term is the full-vocabulary forward KL
    KL(π_T ‖ π_θ) per token instead of the sampled-token reverse KL (SDPO's full_logits mode)."""
    logp = _logp(logits, tokens)
    distil = isdpo_routes(correct, group_ids)
    pg = ppo_clip(logp, old_logp, adv, clip_low, clip_high)
    if teacher_logits is None:
        sd = sampled_reverse_kl(logp, old_logp, teacher_logp)
    else:
        lt, ls = torch.log_softmax(teacher_logits.detach(), -1), torch.log_softmax(logits, -1)
        sd = (lt.exp() * (lt - ls)).sum(-1)
    sd = sd * teacher_on[:, None].to(logp.dtype)
    return route_mean(pg, mask, ~distil, aggregation) + sd_coef * route_mean(sd, mask, distil, aggregation)


# ----------------------------------------------------------------------------------- SC-GRPO
# SC-GRPO (paper: the KL between the self-conditioned and the original distribution weighs the GRPO
# token gradients multiplicatively; the weight's form is reconstructed):
#   ρ_t = exp(teacher_logp - old_logp), teacher = the policy conditioned on a verified sibling y*
#   k_t = ρ log ρ - (ρ - 1)        forward:  KL(π_T || π_θ), sampled-token estimate under y ~ π_θ
#   k_t = (ρ - 1) - log ρ          reverse:  KL(π_θ || π_T) (k3)
#   w_t = clip(k_t^p / mean_{t' ∈ seq} k_{t'}^p, 0, w_max)   (1 where the mean is <= eps or no y*)
#   A_{i,t} = w_t · A_i^GRPO


def sc_token_kl(
    teacher_logp: torch.Tensor, old_logp: torch.Tensor, direction: str = "reverse"
) -> torch.Tensor:
    """Per-token non-negative KL estimate between the self-conditioned and original policies."""
    d = (teacher_logp - old_logp).double()
    rho = torch.exp(d)
    return rho * d - (rho - 1) if direction == "forward" else (rho - 1) - d


def sc_grpo_weights(
    k: torch.Tensor,
    mask: torch.Tensor,
    on: torch.Tensor,
    power: float = 1.0,
    w_max: float = 5.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """w [B, L] from k [B, L] (module comment); on [B]: sequences with a verified sibling."""
    kp = k.clamp(min=0) ** power * mask
    mean = kp.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    use = (mean > eps) & on[:, None].bool()
    w = torch.where(use, kp / torch.where(use, mean, torch.ones_like(mean)), torch.ones_like(kp))
    return w.clamp(0, w_max) * mask


def sc_grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    teacher_logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    on: torch.Tensor,
    direction: str = "reverse",
    power: float = 1.0,
    w_max: float = 5.0,
    scale_by_std: bool = True,
) -> torch.Tensor:
    """[B, L] SC-GRPO token advantages: the GRPO advantage of each sequence times w_t."""
    from reference.advantages import grpo

    a = grpo(rewards, group_ids, scale_by_std)
    w = sc_grpo_weights(sc_token_kl(teacher_logp, old_logp, direction), mask, on, power, w_max)
    return a[:, None] * w


# ----------------------------------------------------------------------------------- U-OPSD
# U-OPSD (reconstructed; the selection rule is SSOPD's with the verifier replaced by a majority vote):
#   â = the most frequent parsed answer of the group (ties: first seen); v = its share of G
#   C = {i: ans_i = â}, W = {i: ans_i ≠ â}; skip the group if v < τ or W = ∅
#   teacher context y_s = argmin_{i ∈ C} |y_i|, target y_w = argmax_{i ∈ W} |y_i| (ties: lowest index)
#   L = mean over targets of (1/|y_w|) Σ_t w(x) sd_t,   w(x) = 4 (|C|/G)(1 − |C|/G) or 1
#   sd_t = the sampled-token reverse KL toward the self-teacher conditioned on y_s (as I-SDPO)


def uopsd_select(answers: list, lengths: list, min_vote: float) -> tuple:
    """(index of y_s, index of y_w, |C| / G) of one group, or (None, None, |C| / G) when skipped.
    ``answers``: parsed answers (None: unparsed, never agrees); ``lengths``: response lengths."""
    counts: dict = {}
    for a in answers:
        if a is not None:
            counts[a] = counts.get(a, 0) + 1
    if not counts:
        return None, None, 0.0
    top = max(counts.values())
    mode = next(a for a in answers if a is not None and counts[a] == top)
    agree = [i for i, a in enumerate(answers) if a == mode]
    wrong = [i for i, a in enumerate(answers) if a != mode]
    share = len(agree) / len(answers)
    if share < min_vote or not wrong:
        return None, None, share
    s = min(agree, key=lambda i: (lengths[i], i))
    w = max(wrong, key=lambda i: (lengths[i], -i))
    return s, w, share


def uopsd_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    target: torch.Tensor,
    agree_share: torch.Tensor,
    frontier: bool = False,
    aggregation: str = "seq-mean-token-mean",
) -> torch.Tensor:
    """U-OPSD loss (comment above). target [B] bool (the y_w of each kept group), agree_share [B]
    (|C| / G of the sequence's group)."""
    logp = _logp(logits, tokens)
    w = 4 * agree_share * (1 - agree_share) if frontier else torch.ones_like(agree_share)
    sd = sampled_reverse_kl(logp, old_logp, teacher_logp) * w[:, None].to(logp.dtype)
    return route_mean(sd, mask, target, aggregation)


def token_divergence(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, direction: str = "forward", top_k: int = 0
) -> torch.Tensor:
    """Per-token KL between the student's and the (detached) teacher's next-token distributions:
    forward KL(teacher ‖ student) or reverse KL(student ‖ teacher), over the full vocabulary
    (``top_k`` 0) or over the teacher's top-K ids with both distributions renormalised there.
    Reconstructed (the full-vocabulary / top-K forms of the sampled-token estimates).  [..., V] -> [...]"""
    t = teacher_logits.detach()
    if top_k:
        ids = torch.topk(t, top_k, dim=-1).indices
        lq = torch.log_softmax(torch.log_softmax(t, -1).gather(-1, ids), -1)
        lp = torch.log_softmax(torch.log_softmax(student_logits, -1).gather(-1, ids), -1)
    else:
        lq, lp = torch.log_softmax(t, -1), torch.log_softmax(student_logits, -1)
    if direction == "forward":
        return (lq.exp() * (lq - lp)).sum(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def uopsd_vocab_loss(
    logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    target: torch.Tensor,
    agree_share: torch.Tensor,
    frontier: bool = False,
    aggregation: str = "seq-mean-token-mean",
    direction: str = "reverse",
    top_k: int = 0,
) -> torch.Tensor:
    """U-OPSD with the sampled-token reverse KL replaced by the KL over the vocabulary (or the
    teacher's top-K) toward the self-teacher conditioned on y_s; the rest as ``uopsd_loss``."""
    w = 4 * agree_share * (1 - agree_share) if frontier else torch.ones_like(agree_share)
    kl = token_divergence(logits, teacher_logits, direction, top_k) * w[:, None].to(logits.dtype)
    return route_mean(kl, mask, target, aggregation)


def sc_grpo_vocab_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    old_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    on: torch.Tensor,
    direction: str = "reverse",
    top_k: int = 0,
    power: float = 1.0,
    w_max: float = 5.0,
    scale_by_std: bool = True,
) -> torch.Tensor:
    """[B, L] SC-GRPO token advantages with k_t the KL between the whole self-conditioned and
    original next-token distributions (logits [B, L, V]; ``top_k``: over the self-teacher's top-K,
    renormalised) instead of the sampled-token estimate; 0 on sequences without a sibling before
    the weight (they keep w = 1). Reconstructed (the paper's KL, taken over the vocabulary)."""
    from reference.advantages import grpo

    k = token_divergence(old_logits, teacher_logits, direction, top_k).double() * on[:, None].double()
    a = grpo(rewards, group_ids, scale_by_std)
    return a[:, None] * sc_grpo_weights(k, mask, on, power, w_max)


def uopsd_select_many(answers: list, lengths: list, min_vote: float, m: int) -> tuple:
    """(indices of the m shortest majority-agreeing rollouts, shortest first, ties by index; the
    index of y_w; |C| / G), or ([], None, |C| / G) when the group is skipped. m = 1 is
    ``uopsd_select``. Reconstructed (U-OPSD averaged over several verified solutions)."""
    s, w, share = uopsd_select(answers, lengths, min_vote)
    if w is None:
        return [], None, share
    mode = answers[s]
    agree = sorted((i for i, a in enumerate(answers) if a == mode and i != w), key=lambda i: (lengths[i], i))
    return agree[:m], w, share


def mixture_logprobs(per_solution: torch.Tensor) -> torch.Tensor:
    """The teacher's logprob of each token under the mixture of its self-conditioned distributions:
    per_solution [c, ...] (one row per solution read: [c, L] logprobs or [c, L, V] log-probabilities)
    -> [...] log((1/c) Σ_j exp(row_j))."""
    n = torch.tensor(float(per_solution.shape[0]), dtype=torch.float64)
    return torch.logsumexp(per_solution.double(), 0) - torch.log(n)
