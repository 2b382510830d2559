"""RRPO's scores in the trainer (rank 0): anchors from the rollout engine, embeddings from the
engine's in-process model, a projection head trained once per step and frozen for scoring.

Per prompt of a rollout round: ``credit.rrpo.anchors`` positive anchors (the prompt with the gold
answer as a hint, ``positive_prompt``) and as many negative ones (a corrupted answer,
``negative_prompt``) are sampled through the engine. Anchors and rollouts are embedded in the
*original* prompt's context: the mean of the model's last hidden state over the response tokens.
The head (made once per run, saved in checkpoints) takes ``head_steps`` Adam steps on the
set-contrastive loss of this round's anchors, is frozen, and each rollout's anchor-alignment score
goes to ``extras["rrpo_scores"]`` for the ``rrpo`` estimator.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from megarl.rewards.shaping.rrpo import ProjectionHead, anchor_scores, sample_anchors, train_head


def corrupt_answer(answer: str) -> str:
    """A wrong answer of the same shape: every digit d -> (d + 1) mod 10, other characters reversed
    in order when there is no digit."""
    if any(c.isdigit() for c in answer):
        return "".join(str((int(c) + 1) % 10) if c.isdigit() else c for c in answer)
    return answer[::-1] if len(answer) > 1 else answer + answer


@torch.no_grad()
def embed_responses(model: torch.nn.Module, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]]
                    ) -> torch.Tensor:
    """Mean last hidden state over each response's tokens in the context of ``prompt_ids``: [n, H]."""
    out = []
    P = len(prompt_ids)
    for r in responses:
        ids = torch.tensor([list(prompt_ids) + list(r)], dtype=torch.long)
        h = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0].float()  # [P+R, H]
        out.append(h[P:].mean(0) if len(r) else h[-1])
    return torch.stack(out)


class RRPOScorer:
    """Anchors, head training and scores; ``state_dict`` holds the head."""

    def __init__(self, cfg, hidden_size: int, seed: int):
        self.cfg = cfg.credit.rrpo
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.head = ProjectionHead(hidden_size, self.cfg.head_dim, self.cfg.head_hidden)

    def _anchor_prompt(self, template: str, key: str, tok: Any, prompt: str, answer: str) -> list[int]:
        text = template.format(prompt=prompt, answer=answer, wrong=corrupt_answer(answer))
        try:
            return list(tok.encode(text))
        except ValueError as e:
            raise ValueError(f"credit.rrpo.{key}: {e}") from None

    def scores(self, model: torch.nn.Module, engine: Any, run: Callable[[Awaitable], Any], tok: Any,
               prompt_ids: Sequence[Sequence[int]], prompts: Sequence[str], answers: Sequence[str],
               response_ids: Sequence[Sequence[int]], n: int, sampling: Any) -> tuple[list[float], dict]:
        """Scores [G * n] of one round's responses (``n`` per prompt, prompts in order) and metrics."""
        c = self.cfg
        anchors, resp_emb = [], []
        for g, (p_ids, p, a) in enumerate(zip(prompt_ids, prompts, answers)):
            pos_ids = self._anchor_prompt(c.positive_prompt, "positive_prompt", tok, p, a)
            neg_ids = self._anchor_prompt(c.negative_prompt, "negative_prompt", tok, p, a)
            pos, neg = run(sample_anchors(engine, pos_ids, neg_ids, n=c.anchors, sampling=sampling))
            anchors.append((embed_responses(model, p_ids, pos), embed_responses(model, p_ids, neg)))
            resp_emb.append(embed_responses(model, p_ids, response_ids[g * n:(g + 1) * n]))
        for q in self.head.parameters():
            q.requires_grad_(True)
        self.head.train()
        hist = train_head(self.head, anchors, steps=c.head_steps, lr=c.lr, tau=c.tau)
        self.head.freeze()
        out: list[float] = []
        for (pos, neg), emb in zip(anchors, resp_emb):
            out += anchor_scores(self.head, emb, pos, neg).tolist()
        s = torch.tensor(out)
        return out, {"rrpo/head_loss_first": hist[0], "rrpo/head_loss_last": hist[-1],
                     "rrpo/score_mean": float(s.mean()), "rrpo/score_std": float(s.std()) if s.numel() > 1 else 0.0}

    def state_dict(self) -> dict:
        return {"head": {k: v.clone() for k, v in self.head.state_dict().items()}}

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
