"""Multi-turn rollouts in the trainer: an environment per sample, episodes through the rollout engine.

``environment: {name: retry, max_turns: 2}`` turns every prompt of the dataset into a small
multi-turn task (``RetryTask``): the model answers; a correct answer (the run's reward functions,
scalar reward >= the best reachable) ends the episode with reward 1; otherwise the environment
appends ``feedback`` (default: the prompt again) as an observation and the model answers again,
up to ``max_turns`` turns. The episode's outcome is the reward of its last answer.

Episodes are played with ``megarl.rollout.environments.run_episode`` (token ids in, token ids out,
no re-tokenisation between turns). Each becomes one training sequence: the prompt, then every
answer and observation; only answer tokens are in the loss, and ``turn_spans`` mark the
``assistant`` steps, so step-level estimators (GiGPO, PGPO) see real steps: all episodes of a
group that failed turn 1 reach the same state (the same observation) and form one anchor group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megarl.rollout.environments import Episode, StepResult, run_episode


class RetryTask:
    """One prompt as a multi-turn environment over token ids (see the module docstring).

    ``score(text) -> float``: the scalar reward of one answer; ``best``: the reward of a correct one.
    """

    def __init__(self, tokenizer: Any, prompt: str, score: Callable[[str], float], best: float,
                 max_turns: int = 2, feedback: str = " {prompt}"):
        self.tok, self.prompt, self.score, self.best = tokenizer, prompt, score, best
        self.max_turns, self.feedback = max_turns, feedback
        self.turn = 0
        self.last_reward = 0.0
        self.last_text = ""

    def reset(self, seed: int | None = None) -> list[int]:
        self.turn, self.last_reward, self.last_text = 0, 0.0, ""
        return list(self.tok.encode(self.prompt))

    def step(self, action_ids: list[int]) -> StepResult:
        self.turn += 1
        self.last_text = self.tok.decode(list(action_ids))
        r = float(self.score(self.last_text))
        self.last_reward = r
        done = r >= self.best or self.turn >= self.max_turns
        obs = [] if done else list(self.tok.encode(self.feedback.format(prompt=self.prompt), bos=False))
        return StepResult(obs, 1.0 if r >= self.best else 0.0, done, {"reward": r})


@dataclass
class EpisodeSample:
    """One episode in the shape of a rollout sample: ``token_ids`` / ``logprobs`` [R] of everything
    after the prompt (answers and observations), ``loss_mask`` [R] (1 on answer tokens), the
    ``turn_spans`` of the whole sequence, and ``text``: the last answer (what the rewards score)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    loss_mask: list[float]
    turn_spans: list[tuple[int, int, str]]
    turns: int
    truncated: bool = False


@dataclass
class EpisodeGroup:
    """The ``n`` episodes of one prompt (like a ``GenerateResult``: ``.samples``)."""

    samples: list[EpisodeSample] = field(default_factory=list)


def episode_sample(ep: Episode, env: RetryTask) -> EpisodeSample:
    """An ``Episode`` (from ``run_episode``) -> ``EpisodeSample``."""
    P = ep.prompt_len
    return EpisodeSample(token_ids=ep.tokens[P:], logprobs=[min(x, 0.0) for x in ep.logprobs[P:]],
                         finish_reason=ep.finish_reasons[-1] if ep.finish_reasons else "stop",
                         text=env.last_text, loss_mask=ep.loss_mask[P:], turn_spans=list(ep.turn_spans),
                         turns=sum(1 for _, _, r in ep.turn_spans if r == "assistant"), truncated=ep.truncated)


async def play_groups(engine: Any, tokenizer: Any, prompts: list[str], n: int, make_sampling: Callable[[int, int], Any],
                      score: Callable[[str, int], float], best: float, max_turns: int, feedback: str,
                      max_len: int | None) -> list[EpisodeGroup]:
    """``n`` episodes per prompt, concurrently. ``make_sampling(g, j)``: the sampling parameters of
    episode j of prompt g (distinct seeds); ``score(text, g)``: the reward of an answer to prompt g."""
    async def one(g: int, j: int) -> EpisodeSample:
        env = RetryTask(tokenizer, prompts[g], lambda t, _g=g: score(t, _g), best, max_turns, feedback)
        ep = await run_episode(engine, env, make_sampling(g, j), max_turns=max_turns, max_len=max_len)
        return episode_sample(ep, env)

    flat = await asyncio.gather(*[one(g, j) for g in range(len(prompts)) for j in range(n)])
    return [EpisodeGroup(list(flat[g * n:(g + 1) * n])) for g in range(len(prompts))]


def apply_episode_structure(batch: Any, response_masks: list[list[float]], turn_spans: list[list]) -> None:
    """Episodes in a batch built by ``from_sequences`` (whose loss mask covers every token after the
    prompt): the loss mask becomes 1 on answer tokens only (``response_masks[i]``: [R_i]) and
    ``batch.turn_spans`` the episodes' turn structure. In place."""
    import torch

    if len(response_masks) != batch.num_seqs or len(turn_spans) != batch.num_seqs:
        raise ValueError(f"{batch.num_seqs} sequences but {len(response_masks)} response masks and "
                         f"{len(turn_spans)} turn-span lists")
    for i, m in enumerate(response_masks):
        start = int(batch.cu_seqlens[i]) + int(batch.prompt_lens[i])
        end = int(batch.cu_seqlens[i + 1])
        if len(m) != end - start:
            raise ValueError(f"sequence {i}: response mask has {len(m)} entries for {end - start} response tokens")
        batch.loss_mask[start:end] = torch.tensor(m, dtype=batch.loss_mask.dtype)
    batch.turn_spans = [list(s) for s in turn_spans]
    batch.validate()
