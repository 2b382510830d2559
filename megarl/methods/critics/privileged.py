"""A privileged critic: the critic reads the policy's prompt with extra context appended (the
reference answer), the policy reads the prompt alone.

``critic_context`` is a round input (rank 0, per rollout round): per sample, the token ids of
``template.format(answer=...)`` (``inputs.critic_context.template``, default ``"{answer}"``), as a
NaN-padded row of ``max_tokens`` in ``batch.extras``. The critic (``inputs.values.context: true``)
then scores and trains on its own packed batch, ``prompt + context + response`` per sequence, and
maps the values back to the policy's token positions: a response token keeps its value of the state
before it, which in the critic's sequence includes the context. Sequences keep their order, so the
critic batch splits into micro-batches and data-parallel shares like the policy's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.ops.segments import token_to_seq
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.knobs import Knobs
from megarl.plugin.rounds import RolloutRound, RoundResult

CONTEXT = "critic_context"


@dataclass
class ContextKnobs(Knobs):
    """template: the text appended to the critic's prompt (``{answer}``: the ground truth);
    max_tokens: the longest context (its row width)."""

    template: str = "{answer}"
    max_tokens: int = 64

    def check(self) -> None:
        """A template that formats with ``answer`` alone; a positive width."""
        try:
            self.template.format(answer="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"template={self.template!r} must format with {{answer}} only ({e})") from None
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")


class CriticContext:
    """A ``RoundProcessor``: ``extras['critic_context']`` [G * n] rows of ``max_tokens`` token ids
    (NaN-padded) of each sample's context. Stateless."""

    def __init__(self, tokenizer: Any, knobs: ContextKnobs):
        self.tokenizer, self.knobs = tokenizer, knobs

    async def process(self, r: RolloutRound) -> RoundResult:
        """The context rows of the round (one per sample, the same for a prompt's samples)."""
        width = self.knobs.max_tokens
        rows, lens = [], []
        for g, answer in enumerate(r.answers):
            text = self.knobs.template.format(answer=answer)
            row = context_row(
                self.tokenizer, text, width, f"inputs.{CONTEXT}: the context of prompt {r.uids[g]}"
            )
            rows += [row] * r.n
            lens.append(width - sum(math.isnan(x) for x in row))
        return RoundResult(
            extras={CONTEXT: rows}, metrics={"critic/context_len": sum(lens) / max(len(lens), 1)}
        )

    def state_dict(self) -> dict:
        """Nothing to save."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


def context_row(tokenizer: Any, text: str, width: int, where: str) -> list[float]:
    """The token ids of ``text`` (no BOS) as a NaN-padded row of ``width`` floats; an empty text
    gives an all-NaN row (no context). Longer than ``width``: an error starting with ``where``."""
    ids = tokenizer.encode(text, bos=False) if text else []
    if len(ids) > width:
        raise ValueError(f"{where} has {len(ids)} tokens, more than max_tokens={width}")
    return [float(t) for t in ids] + [math.nan] * (width - len(ids))


def privileged_batch(batch: PackedBatch, context: torch.Tensor) -> tuple[PackedBatch, torch.Tensor]:
    """The critic's batch and the map of the policy's tokens into it.

    context: [B, K] token ids, NaN-padded on the right. Sequence i becomes prompt_i + context_i +
    response_i; ``index`` [T] is the position of each policy token in the critic batch. The loss
    mask, and ``values``/``returns`` when the batch has them, move with their tokens (0 on the
    context). Per-sequence fields (groups, rewards) are unchanged.
    """
    if context.dim() != 2 or context.shape[0] != batch.num_seqs:
        raise ValueError(
            f"{CONTEXT}: expected [num_seqs={batch.num_seqs}, K] rows, got {tuple(context.shape)}"
        )
    have = ~torch.isnan(context)
    k = have.sum(1)  # [B]
    seq = token_to_seq(batch.cu_seqlens)
    pos = torch.arange(batch.num_tokens) - batch.cu_seqlens[seq]
    lens = batch.seq_lens + k
    cu = torch.zeros_like(batch.cu_seqlens)
    cu[1:] = torch.cumsum(lens, 0)
    index = cu[seq] + pos + k[seq] * (pos >= batch.prompt_lens[seq])
    n = int(cu[-1])
    tokens = torch.zeros(n, dtype=batch.tokens.dtype)
    tokens[index] = batch.tokens
    ctx_seq = have.nonzero()[:, 0]
    ctx_col = have.nonzero()[:, 1]
    tokens[cu[ctx_seq] + batch.prompt_lens[ctx_seq] + ctx_col] = context[have].to(batch.tokens.dtype)

    def moved(x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        out = torch.zeros(n, dtype=x.dtype)
        out[index] = x
        return out

    out = PackedBatch(
        tokens=tokens,
        cu_seqlens=cu,
        prompt_lens=batch.prompt_lens + k,
        loss_mask=moved(batch.loss_mask),
        group_ids=batch.group_ids,
        task_ids=batch.task_ids,
        rewards=batch.rewards,
        values=moved(batch.values),
        returns=moved(batch.returns),
    )
    return out, index


def context_rows(batch: PackedBatch) -> torch.Tensor:
    """``batch.extras['critic_context']`` [B, K] (an error says how to get it)."""
    rows = batch.extras.get(CONTEXT)
    if rows is None:
        raise ValueError(
            "inputs.values.context=true: the batch carries no 'critic_context' rows "
            "(the critic_context round input fills them)"
        )
    return torch.as_tensor(rows, dtype=torch.float64)


CRITIC_CONTEXT = register_provider(
    InputProvider(
        (CONTEXT,),
        "round",
        lambda ctx, names: CriticContext(ctx.tokenizer, ctx.knobs),
        knobs=ContextKnobs,
        summary="per-sample context token ids appended to the critic's prompt (a privileged critic)",
    )
)
