"""Instruction-conditioned sampling (``environment.name: instructed``).

Each sample of a prompt draws one of ``environment.instructions`` or none, uniformly over
``{none, 1..M}`` (a seeded draw per sample: the same seed gives the same draws), and is generated from
``prompt + instruction`` (the instruction's token ids, no BOS, after the prompt's). The trained
sequence is the plain prompt and the response: the instruction shapes only what is sampled. Per
sample the workflow attaches ``extras['instruction']`` (0: none, j: the j-th instruction) and
``extras['instruction_context']`` (the instruction's token ids as a NaN-padded row as wide as the
longest instruction; all NaN: none), the context a learner pass can put back after the prompt.

With no instructions every sample is drawn unconditioned, in one request of ``n`` samples: exactly
the ``none`` workflow.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any

from megarl.plugin.config_parts import chosen_keys, register_keys
from megarl.rollout.types import SamplingParams
from megarl.rollout.workflow import WORKFLOWS, SingleTurn, Trajectory, WorkflowContext, version_of

INDEX = "instruction"
CONTEXT = "instruction_context"


@dataclass
class InstructedKeys:
    """The ``environment.*`` key of the ``instructed`` workflow."""

    instructions: list[str] = field(default_factory=list)  # texts sampled after the prompt


def _check_config(cfg: Any) -> None:
    texts = chosen_keys(cfg.environment, InstructedKeys).instructions
    for j, t in enumerate(texts):
        if not isinstance(t, str) or not t:
            raise ValueError(f"environment.instructions[{j}]={t!r}: a non-empty text expected")


def draw_instructions(num: int, n: int, seed: int) -> list[int]:
    """``n`` instruction indices in ``0..num`` (0: none), uniform, from ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(num + 1) for _ in range(n)]


class InstructedWorkflow:
    """See the module docstring."""

    def __init__(self, ctx: WorkflowContext):
        self.ctx = ctx
        texts = chosen_keys(ctx.env, InstructedKeys).instructions
        self.ids = [list(ctx.tokenizer.encode(t, bos=False)) for t in texts]
        for j, (t, ids) in enumerate(zip(texts, self.ids)):
            if not ids:
                raise ValueError(f"environment.instructions[{j}]={t!r} encodes to no tokens")
        self.width = max((len(x) for x in self.ids), default=1)

    def row(self, j: int) -> list[float]:
        """Instruction ``j``'s context row (0: all NaN)."""
        ids = self.ids[j - 1] if j else []
        return [float(x) for x in ids] + [math.nan] * (self.width - len(ids))

    async def run(
        self, engine: Any, prompt: str, answer: str, prompt_ids: list[int], n: int, sampling: SamplingParams
    ) -> list[Trajectory]:
        """``n`` samples of ``prompt_ids``, each conditioned on its drawn instruction."""
        if not self.ids:
            trajs = await SingleTurn(self.ctx).run(engine, prompt, answer, prompt_ids, n, sampling)
            for t in trajs:
                t.extras = {INDEX: 0.0, CONTEXT: self.row(0)}
            return trajs
        picks = draw_instructions(len(self.ids), n, sampling.seed)
        by_j = {j: [i for i, p in enumerate(picks) if p == j] for j in sorted(set(picks))}

        async def one(j: int, count: int):
            sp = dataclasses.replace(sampling, seed=(sampling.seed * 31 + j) % (2**31))
            ids = prompt_ids + (self.ids[j - 1] if j else [])
            return j, await engine.generate(ids, n=count, sampling=sp)

        out: list[Trajectory | None] = [None] * n
        for j, res in await asyncio.gather(*(one(j, len(ix)) for j, ix in by_j.items())):
            for i, s in zip(by_j[j], res.samples):
                out[i] = Trajectory(
                    list(s.token_ids),
                    list(s.logprobs),
                    s.finish_reason,
                    s.finish_reason == "length",
                    version=version_of(s.weight_version),
                    mixed=bool(s.meta.get("mixed", False)),
                    extras={INDEX: float(j), CONTEXT: self.row(j)},
                )
        return [t for t in out if t is not None]


WORKFLOWS.add("instructed", InstructedWorkflow)
register_keys("environment", "instructed", InstructedKeys, check=_check_config)
