"""On-policy distillation from a teacher.

Sampled-token reverse KL (tokens sampled from the student):
  per-token reward -(log π_s - log π_t); as an importance-weighted policy-gradient loss
  ℓ_t = -sg(teacher_logp - old_logp) · exp(logp - sg(old_logp))
  whose gradient on-policy (logp = old_logp) is (log π_s - log π_t) ∇ log π_s, the unbiased
  reverse-KL gradient estimate. Provenance: on-policy distillation (Agarwal et al. 2024, GKD;
  Thinking Machines "On-Policy Distillation" 2025).
Full-vocabulary KL per token, from student logits z_s and teacher logits z_t:
  forward  KL(π_t || π_s) = Σ_v p_t (log p_t - log p_s)
  reverse  KL(π_s || π_t) = Σ_v p_s (log p_s - log p_t)
"""

import torch


def sampled_reverse_kl(
    logp: torch.Tensor, old_logp: torch.Tensor, teacher_logp: torch.Tensor
) -> torch.Tensor:
    """Per-token sampled reverse-KL policy-gradient loss.  [B, L] -> [B, L]"""
    return -(teacher_logp - old_logp).detach() * torch.exp(logp - old_logp.detach())


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per token.  logits: [B, L, V] -> [B, L]"""
    ls, lt = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    return (lt.exp() * (lt - ls)).sum(-1)


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(student || teacher) per token.  logits: [B, L, V] -> [B, L]"""
    ls, lt = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    return (ls.exp() * (ls - lt)).sum(-1)


def hellinger_sq(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """Squared Hellinger distance H² = 1 - BC,  BC = Σ_v sqrt(p_v q_v) (Bhattacharyya coefficient).

    logits: [B, L, V] -> [B, L]
    """
    lp, lq = torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
    return 1 - torch.exp(0.5 * (lp + lq)).sum(-1)
