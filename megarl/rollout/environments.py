"""Multi-turn environments and the episode runner that turns them into training sequences.

An environment speaks tokens: ``reset`` gives the first prompt's token ids, ``step`` takes the
token ids the model generated and returns observation token ids (appended to the context as
they are), a reward and ``done``. The runner never re-tokenises text between turns: the context
of turn k+1 is exactly the token ids of turn k plus the generated ids plus the observation ids.
Only model-generated tokens enter the loss; prompt and observation tokens are masked out.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megarl.batch import PackedBatch
from megarl.rollout.engine import RolloutEngine
from megarl.rollout.types import SamplingParams


@dataclass
class StepResult:
    """What the environment answers to one model turn."""

    observation_ids: list[int]  # appended to the context, never in the loss
    reward: float
    done: bool
    info: dict = field(default_factory=dict)


class Environment(Protocol):
    """A multi-turn environment over token ids."""

    def reset(self, seed: int | None = None) -> list[int]:
        """Start an episode; return the first prompt as token ids."""

    def step(self, action_ids: list[int]) -> StepResult:
        """Take the model's generated token ids; return observation ids, reward and done."""


class GuessingGame:
    """Guess a secret integer in [lo, hi]. Each turn the model's text is searched for an integer;
    the environment answers "too low", "too high", "correct" (reward 1, done) or "no number".
    The episode ends after ``max_turns`` turns (reward 0)."""

    def __init__(self, tokenizer: Any, lo: int = 1, hi: int = 100, max_turns: int = 3):
        self.tok, self.lo, self.hi, self.max_turns = tokenizer, lo, hi, max_turns
        self.secret: int | None = None
        self.turn = 0

    def _encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def reset(self, seed: int | None = None) -> list[int]:
        self.secret = random.Random(seed).randint(self.lo, self.hi)
        self.turn = 0
        return self._encode(f"user: Guess my number between {self.lo} and {self.hi}.\nassistant:")

    def step(self, action_ids: list[int]) -> StepResult:
        if self.secret is None:
            raise RuntimeError("GuessingGame.step called before reset")
        self.turn += 1
        m = re.search(r"-?\d+", self.tok.decode(action_ids))
        guess = int(m.group()) if m else None
        if guess == self.secret:
            return StepResult(self._encode("\nuser: correct!"), 1.0, True, {"guess": guess})
        if guess is None:
            reply = "no number found"
        else:
            reply = "too low" if guess < self.secret else "too high"
        done = self.turn >= self.max_turns
        return StepResult(self._encode(f"\nuser: {reply}.\nassistant:"), 0.0, done, {"guess": guess})


@dataclass
class Episode:
    """One finished multi-turn episode as one token sequence.

    ``tokens``: [L]; ``loss_mask``: [L] 1 on model-generated tokens only; ``logprobs``: [L] the
    engine's logprob on generated tokens, 0 elsewhere; ``turn_spans``: (start, end, role) with role
    "prompt" | "assistant" | "observation"; ``rewards``: one per turn; ``weight_versions``: the
    version that generated each assistant turn.
    """

    tokens: list[int]
    loss_mask: list[float]
    logprobs: list[float]
    turn_spans: list[tuple[int, int, str]]
    prompt_len: int
    rewards: list[float]
    weight_versions: list[str | None]
    truncated: bool = False
    finish_reasons: list[str] = field(default_factory=list)

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))


async def run_episode(
    engine: RolloutEngine,
    env: Environment,
    sampling: SamplingParams,
    max_turns: int = 8,
    seed: int | None = None,
    max_len: int | None = None,
) -> Episode:
    """Play one episode: generate, step the environment, append its observation, repeat until done,
    ``max_turns`` or the length limit (``truncated``)."""
    prompt = list(env.reset(seed))
    tokens, mask, lps = list(prompt), [0.0] * len(prompt), [0.0] * len(prompt)
    spans: list[tuple[int, int, str]] = [(0, len(prompt), "prompt")]
    ep = Episode(tokens, mask, lps, spans, len(prompt), [], [])
    limit = max_len or engine.max_model_len
    for turn in range(max_turns):
        sp = sampling
        if limit is not None:
            room = limit - len(tokens)
            if room <= 0:
                ep.truncated = True
                break
            if sp.max_new_tokens > room:
                sp = SamplingParams(**{**sp.__dict__, "max_new_tokens": room})
        res = await engine.generate(
            tokens, n=1, sampling=sp, request_id=None if seed is None else f"episode-{seed}-turn-{turn}"
        )
        s = res.samples[0]
        start = len(tokens)
        tokens += s.token_ids
        mask += [1.0] * len(s.token_ids)
        lps += list(s.logprobs)
        if s.token_ids:
            spans.append((start, len(tokens), "assistant"))
        ep.weight_versions.append(s.weight_version)
        ep.finish_reasons.append(s.finish_reason)
        step = env.step(list(s.token_ids))
        ep.rewards.append(float(step.reward))
        if step.done:
            if step.observation_ids:  # a closing observation is kept (masked) for the record
                start = len(tokens)
                tokens += step.observation_ids
                mask += [0.0] * len(step.observation_ids)
                lps += [0.0] * len(step.observation_ids)
                spans.append((start, len(tokens), "observation"))
            break
        if step.observation_ids:
            start = len(tokens)
            tokens += step.observation_ids
            mask += [0.0] * len(step.observation_ids)
            lps += [0.0] * len(step.observation_ids)
            spans.append((start, len(tokens), "observation"))
        if s.finish_reason == "length" and limit is not None and len(tokens) >= limit:
            ep.truncated = True
            break
    return ep


def episodes_to_batch(
    episodes: Sequence[Episode], group_ids: Sequence[int], policy_versions: Sequence[int] | None = None
) -> PackedBatch:
    """Pack episodes into a ``PackedBatch``: ``loss_mask`` covers generated tokens only,
    ``rollout_logprobs`` holds the engine's logprobs, ``turn_spans`` the turn structure, and
    ``rewards`` the episode's total reward."""
    lens = [len(e.tokens) for e in episodes]
    cu = torch.zeros(len(episodes) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.long), 0)
    kw = {}
    if policy_versions is not None:
        kw["policy_versions"] = torch.as_tensor(list(policy_versions), dtype=torch.long)
    return PackedBatch(
        tokens=torch.tensor([t for e in episodes for t in e.tokens], dtype=torch.long),
        cu_seqlens=cu,
        prompt_lens=torch.tensor([e.prompt_len for e in episodes], dtype=torch.long),
        loss_mask=torch.tensor([m for e in episodes for m in e.loss_mask], dtype=torch.float32),
        group_ids=torch.as_tensor(list(group_ids), dtype=torch.long),
        rewards=torch.tensor([e.total_reward for e in episodes], dtype=torch.float32),
        truncated=torch.tensor([e.truncated for e in episodes]),
        turn_spans=[list(e.turn_spans) for e in episodes],
        rollout_logprobs=torch.tensor([x for e in episodes for x in e.logprobs], dtype=torch.float32),
        **kw,
    ).validate()
