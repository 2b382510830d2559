"""Reflective rollouts on reference trajectories (``environment.name: reflect``).

``environment.trajectories`` is a jsonl file of ``{"prompt": <the dataset's prompt text>,
"trajectory": <a reference attempt>}`` rows (e.g. an expert's failed solution). A prompt with a
trajectory that the run's correctness check finds wrong gets a reflection context, the token ids of
``environment.reflect_template`` formatted with ``{trajectory}`` (no BOS). Of its ``n`` samples:

- ``g = min(round(ρ · n / 2), n // 2)`` (halves up) reflective samples, generated from prompt +
  context: the trained sequence is the prompt, the context as an ``observation`` span (never in
  the loss), then the response (``extras['reflect_role'] = 1``);
- ``g`` transfer copies: the same responses as sequences of the plain prompt (role 2), their
  ``extras['reflect_context']`` the context row (a learner pass can read the response with the
  context again); their logprobs are the engine's under the context (the behaviour policy
  that sampled them), so the learner-vs-engine logprob gap of a run counts the context's effect;
- ``n - 2g`` direct samples from the plain prompt (role 0).

ρ = ``reflect_frac`` · max(0, 1 - v / ``reflect_anneal_steps``) with v the engine's policy version
(``reflect_anneal_steps: 0``: no annealing). Every other prompt gets ``n`` direct samples: with no
trajectories the workflow samples exactly as ``none`` does (as one request of ``n``). Every
sample carries ``extras['reflect_role']`` and ``extras['reflect_context']`` (a NaN-padded row as
wide as the longest context; all NaN: none), ``loss_mask`` and ``turn_spans``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.plugin.config_parts import NON_NEGATIVE, Range, chosen_keys, register_keys
from megarl.rollout.types import SamplingParams
from megarl.rollout.workflow import WORKFLOWS, Trajectory, WorkflowContext, version_of

ROLE = "reflect_role"
CONTEXT = "reflect_context"
DIRECT, REFLECTIVE, TRANSFER = 0, 1, 2


@dataclass
class ReflectKeys:
    """The ``environment.*`` keys of the ``reflect`` workflow."""

    trajectories: str | None = None  # jsonl of {"prompt", "trajectory"} (reference attempts)
    reflect_template: str = "{trajectory}"  # the context after the prompt ({trajectory})
    reflect_frac: float = 0.5  # share of a prompt's n samples that reflect (and are copied)
    reflect_anneal_steps: int = 0  # reflect_frac falls linearly to 0 over these versions


def check_keys(keys: ReflectKeys) -> None:
    """``reflect_frac`` in [0, 1], ``reflect_anneal_steps`` >= 0 and a template over ``{trajectory}``."""
    if not 0.0 <= keys.reflect_frac <= 1.0:
        raise ValueError(f"environment.reflect_frac={keys.reflect_frac} must be in [0, 1]")
    if keys.reflect_anneal_steps < 0:
        raise ValueError(f"environment.reflect_anneal_steps={keys.reflect_anneal_steps} must be >= 0")
    try:
        keys.reflect_template.format(trajectory="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"environment.reflect_template={keys.reflect_template!r} must format with {{trajectory}} "
            f"only ({e})"
        ) from None


def _encode(tok: Any, text: str) -> list[int]:
    try:
        return list(tok.encode(text, bos=False))  # megarl's char tokenizer
    except TypeError:
        return list(tok.encode(text, add_special_tokens=False))  # a HF tokenizer


def load_reflection_contexts(
    path: str, tokenizer: Any, template: str
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """(prompt text -> context token ids, prompt text -> trajectory) from the jsonl file ``path``
    (a trajectory whose context is empty is left out). Errors name the file, the line and the field."""
    out: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"environment.trajectories={path!r}: no such file")
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"environment.trajectories {path}, line {i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        for key in ("prompt", "trajectory"):
            if not isinstance(row, dict) or not isinstance(row.get(key), str):
                raise ValueError(f"{where}: field {key!r} must be a string")
        try:
            ids = _encode(tokenizer, template.format(trajectory=row["trajectory"]))
        except ValueError as e:
            raise ValueError(f"{where}: the reflection context cannot be tokenized ({e})") from None
        if ids:
            out[row["prompt"]], texts[row["prompt"]] = ids, row["trajectory"]
    return out, texts


class ReflectWorkflow:
    """See the module docstring."""

    def __init__(self, ctx: WorkflowContext):
        keys = chosen_keys(ctx.env, ReflectKeys)
        check_keys(keys)
        self.ctx = ctx
        self.frac, self.anneal = float(keys.reflect_frac), int(keys.reflect_anneal_steps)
        path, template = keys.trajectories, keys.reflect_template
        self.contexts, self.trajectories = (
            load_reflection_contexts(path, ctx.tokenizer, template) if path else ({}, {})
        )
        self.width = max((len(x) for x in self.contexts.values()), default=1)
        self._wrong: dict[str, bool] = {}

    def row(self, ids: list[int]) -> list[float]:
        """A context row of the workflow's width (``[]``: all NaN)."""
        return [float(t) for t in ids] + [math.nan] * (self.width - len(ids))

    def reflective_count(self, n: int, version: int | None) -> int:
        """``g`` of the module docstring at policy version ``version`` (None: 0)."""
        rho = self.frac
        if self.anneal:
            rho *= max(0.0, 1.0 - (version or 0) / self.anneal)
        return min(math.floor(rho * n / 2 + 0.5), n // 2)  # the nearest count, halves up

    def _context(self, prompt: str, answer: str) -> list[int] | None:
        ids = self.contexts.get(prompt)
        if ids is None:
            return None
        if prompt not in self._wrong:  # only a trajectory the correctness check rejects is a negative
            _, correct = self.ctx.score(self.trajectories[prompt], answer)
            self._wrong[prompt] = not correct
        return ids if self._wrong[prompt] else None

    def _trajectory(self, s: Any, prefix: list[int], P: int, role: int, ctx_row: list[float]) -> Trajectory:
        C, R = len(prefix), len(s.token_ids)
        spans = [(0, P, "prompt")] + ([(P, P + C, "observation")] if C else [])
        spans += [(P + C, P + C + R, "assistant")] if R else []
        return Trajectory(
            prefix + list(s.token_ids),
            [0.0] * C + list(s.logprobs),
            s.finish_reason,
            s.finish_reason == "length",
            text=self.ctx.tokenizer.decode(list(s.token_ids)),
            loss_mask=[0.0] * C + [1.0] * R,
            turn_spans=spans,
            version=version_of(s.weight_version),
            mixed=bool(s.meta.get("mixed", False)),
            extras={ROLE: float(role), CONTEXT: ctx_row},
        )

    async def run(
        self, engine: Any, prompt: str, answer: str, prompt_ids: list[int], n: int, sampling: SamplingParams
    ) -> list[Trajectory]:
        """``n`` samples of ``prompt`` (module docstring)."""
        P = len(prompt_ids)
        ctx_ids = self._context(prompt, answer)
        g = self.reflective_count(n, version_of(getattr(engine, "weight_version", None))) if ctx_ids else 0
        none = self.row([])
        if g == 0:
            res = await engine.generate(prompt_ids, n=n, sampling=sampling)
            return [self._trajectory(s, [], P, DIRECT, none) for s in res.samples]
        assert ctx_ids is not None
        sp = dataclasses.replace(sampling, seed=((sampling.seed or 0) * 31 + 1) % (2**31))
        reflective = engine.generate(prompt_ids + ctx_ids, n=g, sampling=sp)
        if n > 2 * g:
            direct, reflective = await asyncio.gather(
                engine.generate(prompt_ids, n=n - 2 * g, sampling=sampling), reflective
            )
            out = [self._trajectory(s, [], P, DIRECT, none) for s in direct.samples]
        else:
            out, reflective = [], await reflective
        ctx_row = self.row(ctx_ids)
        out += [self._trajectory(s, list(ctx_ids), P, REFLECTIVE, none) for s in reflective.samples]
        out += [self._trajectory(s, [], P, TRANSFER, ctx_row) for s in reflective.samples]
        return out


WORKFLOWS.add("reflect", ReflectWorkflow)
register_keys(
    "environment",
    "reflect",
    ReflectKeys,
    check=lambda cfg: check_keys(chosen_keys(cfg.environment, ReflectKeys)),
    ranges={"reflect_frac": Range(lo=0, hi=1), "reflect_anneal_steps": NON_NEGATIVE},
)
