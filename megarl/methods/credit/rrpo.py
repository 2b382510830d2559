"""RRPO: a projection head trained with a set-contrastive objective on positive/negative anchor sets,
frozen during policy optimisation; group-centred anchor-alignment scores are the advantages
(formulas: reference/reward_shaping.py).

Flow per prompt: sample anchors with ``sample_anchors`` (stratified conditional rollouts: the prompt
with a gold hint for positives, with a corrupted hint for negatives), embed them and the rollouts
(``mean_pool`` of a hidden state over the response tokens), train the head with ``train_head``,
``freeze`` it, put ``anchor_scores`` in ``batch.extras["rrpo_scores"]`` and use the advantage
estimator ``rrpo``. The head's ``state_dict`` goes in checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo, per_token
from megarl.ops.segments import segment_masked_mean
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo
from megarl.rollout.engine import RolloutEngine
from megarl.rollout.types import SamplingParams


class ProjectionHead(torch.nn.Module):
    """f_φ: a two-layer MLP from the embedding width to ``dim`` (small: one device)."""

    def __init__(self, d_in: int, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(d_in, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim)
        )

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return self.net(e)

    def freeze(self) -> ProjectionHead:
        """No gradient reaches φ during policy optimisation."""
        for p in self.parameters():
            p.grad = None
            p.requires_grad_(False)
        return self.eval()


def supcon_loss(pos: torch.Tensor, neg: torch.Tensor, tau: float = 0.1) -> torch.Tensor:
    """Set-contrastive loss of projected anchors pos [P, d], neg [N, d] (P >= 2); scalar."""
    if pos.shape[0] < 2:
        raise ValueError(f"rrpo: the set-contrastive loss needs >= 2 positive anchors, got {pos.shape[0]}")
    z = F.normalize(torch.cat([pos, neg]), dim=-1)
    sim = z[: pos.shape[0]] @ z.T / tau  # [P, P+N]
    P = pos.shape[0]
    self_mask = torch.zeros_like(sim, dtype=torch.bool)
    self_mask[torch.arange(P), torch.arange(P)] = True
    sim = sim.masked_fill(self_mask, -torch.inf)
    log_den = torch.logsumexp(sim, -1)
    log_num = torch.logsumexp(sim[:, :P], -1)
    return (log_den - log_num).mean()


def train_head(
    head: ProjectionHead,
    anchors: Sequence[tuple[torch.Tensor, torch.Tensor]],
    steps: int = 100,
    lr: float = 1e-2,
    tau: float = 0.1,
) -> list[float]:
    """Adam on the mean set-contrastive loss over prompts' (pos [P, d_in], neg [N, d_in]) anchor
    embeddings; returns the loss per step."""
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    hist = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.stack([supcon_loss(head(p), head(n), tau) for p, n in anchors]).mean()
        loss.backward()
        opt.step()
        hist.append(float(loss.detach()))
    return hist


@torch.no_grad()
def anchor_scores(
    head: ProjectionHead, resp: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor
) -> torch.Tensor:
    """S = mean cos(f(y), f(P)) − mean cos(f(y), f(N)); resp [B, d_in] -> [B] (no gradient)."""
    y, p, n = (F.normalize(head(x), dim=-1) for x in (resp, pos, neg))
    s = (y @ p.T).mean(-1)
    return s - (y @ n.T).mean(-1) if n.shape[0] else s


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean of a hidden state over its loss tokens: [T, d] -> [B, d]."""
    return torch.stack(
        [segment_masked_mean(hidden[:, j], mask, cu_seqlens) for j in range(hidden.shape[1])], -1
    )


async def sample_anchors(
    engine: RolloutEngine,
    pos_prompt_ids: Sequence[int],
    neg_prompt_ids: Sequence[int],
    n: int = 4,
    sampling: SamplingParams | None = None,
) -> tuple[list, list]:
    """Stratified conditional rollouts: ``n`` continuations of the prompt with a gold hint
    (positives) and ``n`` of the prompt with a corrupted hint (negatives); token-id lists."""
    sp = sampling or SamplingParams()
    pos = await engine.generate(pos_prompt_ids, n=n, sampling=sp)
    neg = await engine.generate(neg_prompt_ids, n=n, sampling=sp)
    return [s.token_ids for s in pos.samples], [s.token_ids for s in neg.samples]


def _rrpo(batch, scale_by_std: bool = False) -> torch.Tensor:
    """Group-centred ``extras["rrpo_scores"]`` on every loss token; [T]."""
    if "rrpo_scores" not in batch.extras:
        raise ValueError("advantage_estimator=rrpo needs batch.extras['rrpo_scores'] (see anchor_scores)")
    return per_token(batch, grpo(batch.extras["rrpo_scores"].double(), batch.group_ids, scale_by_std))


ADVANTAGE_ESTIMATORS.add("rrpo", _rrpo, PartInfo(batch_inputs=("rrpo_scores",), group_relative=True))

SPEC = MethodSpec(
    name="rrpo",
    summary="RRPO: advantages from a contrastive anchor-alignment score",
    provenance="reconstructed",
    config={"advantage": {"estimator": "rrpo"}},
)
