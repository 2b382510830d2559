"""SRPO (Self-Reflective Policy Optimization): after a rollout the policy writes a short reflection
patch p on it (its errors, given the verifier's feedback); the same weights reading the prompt with
p act as the teacher of the rollout's tokens. Formula and provenance: reference/agents.py
``srpo_advantages`` (reconstructed from the abstract; the authors' code could not be read).

Parts:

- ``reflection_patch`` (round input, rank 0): per sample, the patch's token ids as a NaN-padded
  row of ``max_tokens`` (``extras['reflection_patch']``). ``mode: generate`` asks the run's engine
  (the current policy) for ``max_tokens`` tokens after ``prompt`` formatted with ``{prompt}``,
  ``{response}`` and ``{feedback}`` (``feedback_correct`` or ``feedback_incorrect``, from the run's
  correctness check); ``mode: template`` writes ``template`` formatted with ``{response}``,
  ``{feedback}`` and ``{answer}`` instead (a templated stand-in for a model that cannot reflect
  yet). ``when: incorrect`` gives patches to wrong samples only (the others get none: ℓ = 0).
- ``reflection_logprobs`` (learner input, every rank): the policy's logprobs of each rollout with
  its patch after the prompt, one extra forward of the patched sequences (the context teacher of
  megarl/methods/agents/context_teacher.py: ``batch.self_teacher_logprobs``,
  ``extras['self_teacher_on']``).
- the ``srpo`` advantage estimator: A_t = A^GRPO + coef · clip(ℓ_t), ℓ_t = reflection_logprobs −
  old_logprobs (stop-gradient), then the objective's PPO clip.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo, per_token, scalar_rewards
from megarl.batch import PackedBatch
from megarl.methods.agents.context_teacher import ContextTeacher
from megarl.methods.agents.privileged_gap import context_ids_row, eos_id, token_gap
from megarl.methods.distillation.self_teacher import ON
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.knobs import Knobs
from megarl.plugin.rounds import RolloutRound, RoundResult
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo
from megarl.rollout.tool_env import encode_observation

PATCH = "reflection_patch"
LOGPROBS = "reflection_logprobs"
MODES = ("generate", "template")


@dataclass
class PatchKnobs(Knobs):
    """See the module docstring."""

    mode: str = "generate"
    prompt: str = "{prompt}{response}\nfeedback: {feedback}\nreflection:"
    template: str = " earlier: {response} was {feedback}."
    feedback_correct: str = "correct"
    feedback_incorrect: str = "wrong"
    when: str = "all"
    max_tokens: int = 32

    def check(self) -> None:
        """Known mode and ``when``, templates that format with their own fields, a positive width."""
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}; known: {', '.join(MODES)}")
        if self.when not in ("all", "incorrect"):
            raise ValueError(f"when={self.when!r}; known: all, incorrect")
        for name, fields in (
            ("prompt", ("prompt", "response", "feedback")),
            ("template", ("response", "feedback", "answer")),
        ):
            try:
                getattr(self, name).format(**{f: "" for f in fields})
            except (KeyError, IndexError, ValueError) as e:
                allowed = ", ".join("{" + f + "}" for f in fields)
                raise ValueError(
                    f"{name}={getattr(self, name)!r} must format with {allowed} only ({e})"
                ) from None
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")


class ReflectionPatch:
    """A ``RoundProcessor``: the round's reflection patches (module docstring). Stateless.

    engine: rank 0's rollout engine (``mode: generate``); sampling: the run's seeded
    ``sampling(step, round, index)``."""

    def __init__(self, tokenizer: Any, knobs: PatchKnobs, engine: Any = None, sampling: Any = None):
        if knobs.mode == "generate" and (engine is None or sampling is None):
            raise ValueError(f"inputs.{PATCH}.mode=generate needs rank 0's rollout engine")
        self.tok, self.knobs, self.engine, self.sampling = tokenizer, knobs, engine, sampling

    def _verdicts(self, r: RolloutRound) -> list[bool]:
        if r.correct is None:
            raise ValueError(
                f"inputs.{PATCH}: the feedback needs the run's correctness check (mark the verifier with "
                "reward.functions[i].correct: true)"
            )
        return [bool(c) for c in r.correct.tolist()]

    async def _generate(self, r: RolloutRound, i: int, feedback: str) -> list[int]:
        k = self.knobs
        text = k.prompt.format(prompt=r.prompts[i // r.n], response=r.texts[i], feedback=feedback)
        sp = dataclasses.replace(self.sampling(r.step, 2000 + r.round, i), max_new_tokens=k.max_tokens)
        out = await self.engine.generate(list(self.tok.encode(text)), n=1, sampling=sp)
        eos = eos_id(self.tok)
        return [t for t in out.samples[0].token_ids if t != eos]

    async def process(self, r: RolloutRound) -> RoundResult:
        """``extras['reflection_patch']`` [G * n] rows and the mean patch length."""
        k = self.knobs
        correct = self._verdicts(r)
        chosen = [i for i, c in enumerate(correct) if k.when == "all" or not c]
        fb = [k.feedback_correct if c else k.feedback_incorrect for c in correct]
        if k.mode == "generate":
            ids = await asyncio.gather(*[self._generate(r, i, fb[i]) for i in chosen])
        else:
            ids = [
                encode_observation(
                    self.tok,
                    k.template.format(response=r.texts[i], feedback=fb[i], answer=r.answers[i // r.n]),
                )
                for i in chosen
            ]
        rows = [context_ids_row([], k.max_tokens)] * len(r.texts)
        for i, x in zip(chosen, ids):
            rows[i] = context_ids_row(x, k.max_tokens)
        lens = [min(len(x), k.max_tokens) for x in ids]
        return RoundResult(
            extras={PATCH: rows},
            metrics={
                "srpo/patch_frac": sum(n > 0 for n in lens) / max(len(rows), 1),
                "srpo/patch_len": sum(lens) / max(len(lens), 1),
            },
        )

    def state_dict(self) -> dict:
        """Nothing to save."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


def _patch(ctx: Any, names: frozenset) -> ReflectionPatch:
    return ReflectionPatch(ctx.tokenizer, ctx.knobs, ctx.engine, ctx.sampling)


register_provider(
    InputProvider(
        (PATCH,),
        "round",
        _patch,
        knobs=PatchKnobs,
        summary="per-sample reflection patch: the policy's own short reflection on its rollout and the "
        "verifier's feedback (or a template), as context token ids",
    )
)
register_provider(
    InputProvider(
        (LOGPROBS,),
        "learner",
        lambda ctx, names: ContextTeacher(ctx.policy, PATCH, LOGPROBS, (PATCH,)),
        summary="the policy's logprobs of each rollout with its reflection patch after the prompt "
        "(one extra forward)",
    )
)


def srpo_gap(batch: PackedBatch, gap_clip: float = 2.0) -> torch.Tensor:
    """[T] ℓ_t = reflection_logprobs − old_logprobs on loss tokens of patched samples (0 elsewhere),
    clipped to [−gap_clip, gap_clip] when gap_clip > 0."""
    gap = token_gap(batch, batch.self_teacher_logprobs, batch.extras.get(ON), f"the {LOGPROBS} input")
    return gap.clamp(-gap_clip, gap_clip) if gap_clip > 0 else gap


def _srpo(
    batch: PackedBatch,
    coef: float = 1.0,
    gap_clip: float = 2.0,
    with_outcome: bool = True,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages plus coef x the reflection-patch teacher's clipped token gap (or the gap alone)."""
    if coef < 0 or gap_clip < 0:
        raise ValueError(f"advantage.coef={coef} and advantage.gap_clip={gap_clip} must be >= 0")
    gap = srpo_gap(batch, gap_clip)
    base = (
        per_token(batch, grpo(scalar_rewards(batch), batch.group_ids, scale_by_std, eps))
        if with_outcome
        else torch.zeros_like(gap)
    )
    return base + coef * gap * batch.loss_mask.double()


ADVANTAGE_ESTIMATORS.add(
    "srpo", _srpo, PartInfo(batch_inputs=("old_logprobs", LOGPROBS), group_relative=True)
)

SPEC = MethodSpec(
    name="srpo",
    summary="SRPO: GRPO plus a dense token signal from the policy reading its own reflection patch",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "srpo"},
        "inputs": {PATCH: {"mode": "generate"}},
    },
)
