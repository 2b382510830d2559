"""RRPO's scores, a round provider (rank 0): anchors from the rollout engine, embeddings from the
engine's in-process model, a projection head trained once per step and frozen for scoring.

Per prompt of a rollout round: ``inputs.rrpo_scores.anchors`` positive anchors (the prompt with the gold
answer as a hint, ``positive_prompt``) and as many negative ones (a corrupted answer,
``negative_prompt``) are sampled through the engine. Anchors and rollouts are embedded in the
*original* prompt's context: the mean of the model's last hidden state over the response tokens.
The head (made once per run, saved in checkpoints) takes ``head_steps`` Adam steps on the
set-contrastive loss of this round's anchors, is frozen, and each rollout's anchor-alignment score
goes to ``extras["rrpo_scores"]`` for the ``rrpo`` estimator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megarl.methods.credit.rrpo import ProjectionHead, anchor_scores, sample_anchors, train_head
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.knobs import Knobs
from megarl.plugin.rounds import RolloutRound, RoundResult


def corrupt_answer(answer: str) -> str:
    """A wrong answer of the same shape: every digit d -> (d + 1) mod 10, other characters reversed
    in order when there is no digit."""
    if any(c.isdigit() for c in answer):
        return "".join(str((int(c) + 1) % 10) if c.isdigit() else c for c in answer)
    return answer[::-1] if len(answer) > 1 else answer + answer


@torch.no_grad()
def embed_responses(
    model: torch.nn.Module, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Mean last hidden state over each response's tokens in the context of ``prompt_ids``: [n, H]."""
    out = []
    P = len(prompt_ids)
    for r in responses:
        ids = torch.tensor([list(prompt_ids) + list(r)], dtype=torch.long)
        h = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0].float()  # [P+R, H]
        out.append(h[P:].mean(0) if len(r) else h[-1])
    return torch.stack(out)


@dataclass
class RRPOKnobs(Knobs):
    """RRPO's anchors and projection head (``inputs.rrpo_scores``). Anchor prompts are ``str.format``
    templates over ``prompt``, ``answer`` and ``wrong`` (a corrupted answer)."""

    anchors: int = 4  # positive and negative anchor samples per prompt
    positive_prompt: str = "{answer} {prompt}"
    negative_prompt: str = "{wrong} {prompt}"
    head_dim: int = 32
    head_hidden: int = 64
    head_steps: int = 20  # Adam steps on the set-contrastive loss per RL step
    lr: float = 1.0e-2
    tau: float = 0.1

    def check(self) -> None:
        """Sizes > 0, at least 2 anchors, templates over {prompt}, {answer}, {wrong} only."""
        for key in ("anchors", "head_dim", "head_hidden", "head_steps", "lr", "tau"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key}={getattr(self, key)} must be > 0")
        if self.anchors < 2:
            raise ValueError(
                f"anchors={self.anchors} must be >= 2 (the set-contrastive loss needs 2 positive anchors)"
            )
        for key in ("positive_prompt", "negative_prompt"):
            try:
                getattr(self, key).format(prompt="", answer="", wrong="")
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(
                    f"{key}={getattr(self, key)!r}: only {{prompt}}, {{answer}} and {{wrong}} may be "
                    f"used ({e!r})"
                ) from None


class RRPOScorer:
    """A ``RoundProcessor``: anchors, head training and ``extras["rrpo_scores"]``; ``state_dict``
    holds the head. ``model``: the engine's in-process HF model (the embedded engine);
    ``sampling(step, round, index)``: the run's sampling parameters."""

    def __init__(
        self,
        knobs: RRPOKnobs,
        hidden_size: int,
        seed: int,
        engine: Any = None,
        tokenizer: Any = None,
        sampling: Any = None,
    ):
        self.cfg = knobs
        self.engine, self.tok, self.sampling = engine, tokenizer, sampling
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.head = ProjectionHead(hidden_size, knobs.head_dim, knobs.head_hidden)

    def _anchor_prompt(self, template: str, key: str, tok: Any, prompt: str, answer: str) -> list[int]:
        text = template.format(prompt=prompt, answer=answer, wrong=corrupt_answer(answer))
        try:
            return list(tok.encode(text))
        except ValueError as e:
            raise ValueError(f"inputs.rrpo_scores.{key}: {e}") from None

    async def process(self, r: RolloutRound) -> RoundResult:
        """Scores [G * n] of the round's responses in ``extras["rrpo_scores"]`` and the head's metrics."""
        scores, m = await self.scores(
            self.engine.model,
            self.engine,
            self.tok,
            r.prompt_ids,
            r.prompts,
            r.answers,
            r.response_ids,
            r.n,
            self.sampling(r.step, r.round + 1000, 0),
        )
        return RoundResult(extras={"rrpo_scores": scores}, metrics=m)

    async def scores(
        self,
        model: torch.nn.Module,
        engine: Any,
        tok: Any,
        prompt_ids: Sequence[Sequence[int]],
        prompts: Sequence[str],
        answers: Sequence[str],
        response_ids: Sequence[Sequence[int]],
        n: int,
        sampling: Any,
    ) -> tuple[list[float], dict]:
        """Scores [G * n] of one round's responses (``n`` per prompt, prompts in order) and metrics."""
        c = self.cfg
        anchors, resp_emb = [], []
        for g, (p_ids, p, a) in enumerate(zip(prompt_ids, prompts, answers)):
            pos_ids = self._anchor_prompt(c.positive_prompt, "positive_prompt", tok, p, a)
            neg_ids = self._anchor_prompt(c.negative_prompt, "negative_prompt", tok, p, a)
            pos, neg = await sample_anchors(engine, pos_ids, neg_ids, n=c.anchors, sampling=sampling)
            anchors.append((embed_responses(model, p_ids, pos), embed_responses(model, p_ids, neg)))
            resp_emb.append(embed_responses(model, p_ids, response_ids[g * n : (g + 1) * n]))
        for q in self.head.parameters():
            q.requires_grad_(True)
        self.head.train()
        hist = train_head(self.head, anchors, steps=c.head_steps, lr=c.lr, tau=c.tau)
        self.head.freeze()
        out: list[float] = []
        for (pos, neg), emb in zip(anchors, resp_emb):
            out += anchor_scores(self.head, emb, pos, neg).tolist()
        s = torch.tensor(out)
        return out, {
            "rrpo/head_loss_first": hist[0],
            "rrpo/head_loss_last": hist[-1],
            "rrpo/score_mean": float(s.mean()),
            "rrpo/score_std": float(s.std()) if s.numel() > 1 else 0.0,
        }

    def state_dict(self) -> dict:
        """The projection head's weights."""
        return {"head": {k: v.clone() for k, v in self.head.state_dict().items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""
        self.head.load_state_dict(state["head"])


def build_scorer(ctx: Any, names: frozenset) -> RRPOScorer:
    """The round provider of ``rrpo_scores``: needs the embedded engine (anchors and rollouts are
    embedded with its in-process model)."""
    if ctx.cfg.rollout.engine != "embedded":
        raise ValueError(
            "the rrpo_scores input (advantage.estimator=rrpo) needs rollout.engine: embedded (the "
            "anchors and rollouts are embedded with the engine's in-process model)"
        )
    return RRPOScorer(
        ctx.knobs,
        int(ctx.hf_config["hidden_size"]),
        ctx.cfg.model.seed,
        ctx.engine,
        ctx.tokenizer,
        ctx.sampling,
    )


register_provider(
    InputProvider(
        ("rrpo_scores",),
        "round",
        build_scorer,
        knobs=RRPOKnobs,
        summary="RRPO's anchor-alignment scores (rank 0, each round)",
        # the knobs were the config's `credit.rrpo` section before methods became plugins
        moved_from=tuple((f"credit.rrpo.{f.name}", f.name) for f in dataclasses.fields(RRPOKnobs)),
    )
)
