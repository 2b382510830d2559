"""Self-review episodes (``environment.name: review``): attempt, review on failure, second attempt.

Per sample: a first answer a_1 from the prompt (the prompt's n first answers in one request, as
the single-turn workflow makes them). A correct a_1 (the run's correctness check) ends
the episode. Otherwise the model sees ``environment.feedback`` (a template over ``{prompt}``)
followed by the reviews the workflow's memory retrieves for this prompt (``WorkflowContext.parts
["memory"]``: ``retrieve(prompt) -> list[str]``, each appended after a space; none without a
memory), writes a review c, sees ``environment.after_review`` (a template over ``{prompt}``), and
answers again (a_2). The episode is one training sequence ``prompt, a_1, feedback, c, cue, a_2``
with a_1, c and a_2 in the loss; ``turn_spans`` mark them ``assistant``, ``review``, ``assistant``
and the rest ``prompt`` / ``observation``. The run's rewards score the last answer. A review whose
second attempt is correct goes to the memory (``add(prompt, review_text)``).

Per sample the workflow attaches ``extras``: ``review_r1`` / ``review_r2`` (the run's scalar
reward of a_1 and of the last answer), ``review_c1`` / ``review_c2`` (their correctness, 1/0) and
``reviewed`` (1 when the episode had a review).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

from megarl.plugin.config_parts import chosen_keys, register_keys
from megarl.rollout.types import SamplingParams
from megarl.rollout.workflow import WORKFLOWS, Trajectory, WorkflowContext, version_of

KEYS = ("review_r1", "review_r2", "review_c1", "review_c2", "reviewed")


@dataclass
class ReviewKeys:
    """The ``environment.*`` keys of the ``review`` workflow (beside ``feedback`` and ``max_turns``)."""

    after_review: str = " {prompt}"  # the observation after the review (template over {prompt})


def check_templates(feedback: str, keys: ReviewKeys) -> None:
    """``environment.feedback`` and ``environment.after_review`` format with ``{prompt}`` only."""
    for key, text in (("feedback", feedback), ("after_review", keys.after_review)):
        try:
            text.format(prompt="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"environment.{key}={text!r}: only {{prompt}} may be used ({e!r})") from None


def _check_config(cfg: Any) -> None:
    """The run config's review templates (``check_templates``)."""
    check_templates(cfg.environment.feedback, chosen_keys(cfg.environment, ReviewKeys))


class ReviewWorkflow:
    """See the module docstring."""

    def __init__(self, ctx: WorkflowContext):
        self.ctx = ctx
        self.memory = ctx.parts.get("memory")
        self.keys = chosen_keys(ctx.env, ReviewKeys)
        check_templates(ctx.env.feedback, self.keys)

    def _encode(self, text: str) -> list[int]:
        return list(self.ctx.tokenizer.encode(text, bos=False)) if text else []

    async def _turn(self, engine: Any, ids: list[int], sp: SamplingParams, n: int = 0):
        """One generation after ``ids`` (``n`` > 0: the list of ``n`` samples); None when the
        context has no room left."""
        limit = self.ctx.max_len or getattr(engine, "max_model_len", None)
        if limit is not None:
            room = limit - len(ids)
            if room <= 0:
                return None
            sp = dataclasses.replace(sp, max_new_tokens=min(sp.max_new_tokens, room))
        samples = (await engine.generate(ids, n=max(n, 1), sampling=sp)).samples
        return list(samples) if n else samples[0]

    async def episode(
        self, engine: Any, prompt: str, answer: str, prompt_ids: list[int], s1: Any, sp: SamplingParams
    ) -> Trajectory:
        """One episode from its first answer ``s1`` (module docstring)."""
        c, env, tok = self.ctx, self.ctx.env, self.ctx.tokenizer
        P = len(prompt_ids)
        a1 = list(s1.token_ids)
        t1 = tok.decode(a1)
        r1, c1 = c.score(t1, answer)
        versions = [version_of(s1.weight_version)]
        tokens, lps, mask = list(a1), [min(x, 0.0) for x in s1.logprobs], [1.0] * len(a1)
        spans = [(0, P, "prompt"), (P, P + len(a1), "assistant")]
        text, r2, c2, reviewed = t1, r1, c1, 0.0
        finish = s1.finish_reason
        if not c1:
            reviews = self.memory.retrieve(prompt) if self.memory is not None else []
            obs1 = self._encode(env.feedback.format(prompt=prompt) + "".join(" " + r for r in reviews))
            seed = (sp.seed or 0) * 7 + 1
            ctx_ids = prompt_ids + a1 + obs1
            rv = await self._turn(engine, ctx_ids, dataclasses.replace(sp, seed=seed % (2**31)))
            if rv is not None:
                obs2 = self._encode(self.keys.after_review.format(prompt=prompt))
                s2 = await self._turn(
                    engine,
                    ctx_ids + list(rv.token_ids) + obs2,
                    dataclasses.replace(sp, seed=(seed + 1) % (2**31)),
                )
                if s2 is not None:
                    review, a2 = list(rv.token_ids), list(s2.token_ids)
                    text = tok.decode(a2)
                    r2, c2 = c.score(text, answer)
                    reviewed = 1.0
                    finish = s2.finish_reason
                    versions += [version_of(rv.weight_version), version_of(s2.weight_version)]
                    at = P + len(tokens)
                    parts = [(obs1, "observation", None), (review, "review", rv), (obs2, "observation", None)]
                    parts.append((a2, "assistant", s2))
                    for ids, role, s in parts:
                        if ids:
                            spans.append((at, at + len(ids), role))
                        tokens += ids
                        lps += [0.0] * len(ids) if s is None else [min(x, 0.0) for x in s.logprobs]
                        mask += [0.0 if s is None else 1.0] * len(ids)
                        at += len(ids)
                    if c2 and self.memory is not None:
                        self.memory.add(prompt, tok.decode(review))
        known = [v for v in versions if v is not None]
        return Trajectory(
            tokens,
            lps,
            finish,
            finish == "length",
            text=text,
            loss_mask=mask,
            turn_spans=spans,
            version=min(known) if known else None,
            mixed=len(set(known)) > 1,
            extras=dict(
                zip(KEYS, (float(r1), float(r2), float(bool(c1)), float(bool(c2)), reviewed), strict=True)
            ),
        )

    async def run(
        self, engine: Any, prompt: str, answer: str, prompt_ids: list[int], n: int, sampling: SamplingParams
    ) -> list[Trajectory]:
        """``n`` episodes of ``prompt``: the first answers in one request of ``n`` samples (as the
        single-turn workflow), then the reviews and second answers concurrently (episode j's with
        seeds from ``seed * 31 + j``)."""
        first = await self._turn(engine, prompt_ids, sampling, n)
        if first is None:
            raise ValueError(
                f"review workflow: the prompt ({len(prompt_ids)} tokens) leaves no room in the context"
            )
        sps = [
            dataclasses.replace(sampling, seed=((sampling.seed or 0) * 31 + j) % (2**31)) for j in range(n)
        ]
        eps = [self.episode(engine, prompt, answer, prompt_ids, s, sp) for s, sp in zip(first, sps)]
        return list(await asyncio.gather(*eps))


WORKFLOWS.add("review", ReviewWorkflow)
register_keys("environment", "review", ReviewKeys, check=_check_config)
