"""Experiential Learning (LLM-as-a-Coach): a coach turns its assessment of each on-policy response
into knowledge text k_i; the policy reading ``prompt + k_i`` is the teacher, and the policy without
it absorbs the knowledge by on-policy context distillation. Registered as the round input
``coach_context`` and the policy loss ``el`` (formula: reference/agents.py:el_loss). Reconstructed:
no source was found; the formula is ours.

    ℓ_t  = log π^sg(y_t|x, k_i, y_<t) − log π_θ(y_t|x, y_<t)
    loss_t = −sg(ℓ_t) · exp(log π_θ − sg(log π_old))    (sampled-token OPD; on-policy: −sg(ℓ_t) ∇log π_θ)
           + rl_coef · PPO-clip(A_i)                     (the optional small rubric-RL term)

The distillation term is 0 on samples without knowledge (k = ∅: teacher = student). The coach
(``inputs.coach_context``): ``coach: template`` formats ``template`` per sample (a templated coach);
``coach: policy`` sends ``template`` (the coach prompt) to the run's own rollout engine, the policy as
its own coach, and its reply is the knowledge. ``when`` picks the samples that get knowledge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from megarl.methods.agents.context_teacher import COACH_LOGPROBS, COACH_ROWS
from megarl.methods.critics.privileged import context_row
from megarl.methods.distillation.self_teacher import ON
from megarl.objectives.distillation import sampled_reverse_kl_term
from megarl.objectives.policy_losses import POLICY_LOSSES, ppo, seq_to_tokens
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.knobs import Knobs
from megarl.plugin.rounds import RolloutRound, RoundResult
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo
from megarl.rollout.types import SamplingParams

COACHES = ("template", "policy")
WHEN = ("all", "incorrect", "correct")
FIELDS = {"prompt": "", "response": "", "answer": "", "verdict": ""}


@dataclass
class CoachKnobs(Knobs):
    """coach: template | policy; template: the knowledge (``template``) or the coach's prompt
    (``policy``), formatted with {prompt}, {response}, {answer}, {verdict}; verdict_correct /
    verdict_incorrect: what {verdict} says; when: all | incorrect | correct (which samples get
    knowledge); max_tokens: the longest knowledge (its row width; the policy coach's reply length);
    temperature: the policy coach's sampling temperature (0: greedy)."""

    coach: str = "template"
    template: str = "{answer}"
    verdict_correct: str = "correct"
    verdict_incorrect: str = "incorrect"
    when: str = "all"
    max_tokens: int = 16
    temperature: float = 0.0

    def check(self) -> None:
        """Names, ranges and a template that formats with the four fields only."""
        if self.coach not in COACHES:
            raise ValueError(f"coach={self.coach!r}; known: {', '.join(COACHES)}")
        if self.when not in WHEN:
            raise ValueError(f"when={self.when!r}; known: {', '.join(WHEN)}")
        try:
            self.template.format(**FIELDS)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"template={self.template!r} may use {{prompt}} {{response}} {{answer}} "
                f"{{verdict}} only ({e})"
            ) from None
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")


def coached(correct: list[bool], when: str) -> list[bool]:
    """Which samples get knowledge."""
    return [when == "all" or (c if when == "correct" else not c) for c in correct]


class Coach:
    """A ``RoundProcessor``: ``extras['coach_context']`` [G * n] rows of each sample's knowledge
    (all NaN: none). Stateless."""

    def __init__(self, tokenizer: Any, knobs: CoachKnobs, engine: Any = None):
        if knobs.coach == "policy" and engine is None:
            raise ValueError(f"inputs.{COACH_ROWS}.coach=policy needs the run's rollout engine (rank 0)")
        self.tok, self.knobs, self.engine = tokenizer, knobs, engine

    async def _reply(self, text: str, seed: int) -> str:
        k = self.knobs
        sp = SamplingParams(temperature=k.temperature, max_new_tokens=k.max_tokens, seed=seed)
        res = await self.engine.generate(list(self.tok.encode(text)), n=1, sampling=sp)
        return self.tok.decode(list(res.samples[0].token_ids)[: k.max_tokens])

    async def process(self, r: RolloutRound) -> RoundResult:
        """The knowledge rows of the round."""
        import asyncio

        k = self.knobs
        if r.correct is None:
            raise ValueError(
                f"inputs.{COACH_ROWS}: the coach needs the run's correctness check (mark the verifier "
                "with reward.functions[i].correct: true)"
            )
        correct = [bool(c) for c in r.correct.tolist()]
        texts: list[str] = []
        for i, ok in enumerate(correct):
            g = i // r.n
            verdict = k.verdict_correct if ok else k.verdict_incorrect
            texts.append(
                k.template.format(
                    prompt=r.prompts[g], response=r.texts[i], answer=r.answers[g], verdict=verdict
                )
            )
        chosen = coached(correct, k.when)
        if k.coach == "policy":
            seeds = [(r.step * 1_000_003 + r.round * 7919 + i) % (2**31) for i in range(len(texts))]
            replies = await asyncio.gather(*(self._reply(t, s) for t, s, c in zip(texts, seeds, chosen) if c))
            it = iter(replies)
            texts = [next(it) if c else "" for c in chosen]
        rows = []
        for i, (t, c) in enumerate(zip(texts, chosen)):
            where = f"inputs.{COACH_ROWS}: the knowledge of sample {i % r.n} of prompt {r.uids[i // r.n]}"
            rows.append(context_row(self.tok, t if c else "", k.max_tokens, where))
        lens = [sum(not math.isnan(x) for x in row) for row in rows]
        on = [x for x in lens if x]
        return RoundResult(
            extras={COACH_ROWS: rows},
            metrics={
                "coach/knowledge_frac": len(on) / max(len(rows), 1),
                "coach/knowledge_len": sum(on) / max(len(on), 1),
            },
        )

    def state_dict(self) -> dict:
        """Nothing to save."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


register_provider(
    InputProvider(
        (COACH_ROWS,),
        "round",
        lambda ctx, names: Coach(ctx.tokenizer, ctx.knobs, ctx.engine),
        knobs=CoachKnobs,
        summary="per-sample knowledge text of a coach (a template, or the policy through the run's engine)",
    )
)


def el_loss(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    *,
    rl_coef: float = 0.0,
    batch=None,
    ctx=None,
) -> torch.Tensor:
    """Per-token loss: sampled-token OPD toward the coached teacher on coached samples, plus
    rl_coef x PPO clip."""
    teacher = batch.self_teacher_logprobs
    if teacher is None or ON not in batch.extras:
        raise ValueError(
            f"policy_loss=el needs 'self_teacher_logprobs' and extras['{ON}'] ({COACH_LOGPROBS})"
        )
    on = seq_to_tokens(batch.extras[ON], batch.seq_lens, logp)
    out = on * sampled_reverse_kl_term(logp, old_logp, teacher.to(logp.dtype))
    if rl_coef:
        out = out + rl_coef * ppo(logp, old_logp, adv, mask, cu_seqlens, clip_low, clip_high, dual_clip)
    return out


def _token_metrics(logp, old_logp, adv, mask, cu_seqlens, *, batch, **_):
    """Per token: whether it is coached, and the teacher-minus-student gap ℓ_t there."""
    on = seq_to_tokens(batch.extras[ON], batch.seq_lens, logp)
    return {"coached": on, "gap": on * (batch.self_teacher_logprobs.to(logp.dtype) - old_logp)}


POLICY_LOSSES.add(
    "el",
    el_loss,
    PartInfo(batch_inputs=(COACH_LOGPROBS,), token_metrics=_token_metrics, needs_context=True),
)


@dataclass
class ELKnobs(Knobs):
    """No knobs of its own: the coach is ``inputs.coach_context``, the RL weight
    ``objective.policy_loss_args.rl_coef``."""


SPEC = MethodSpec(
    name="el",
    summary="Experiential Learning: a coach's knowledge in context teaches the plain policy (context OPD)",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "grpo"},
        "objective": {"policy_loss": "el", "policy_loss_args": {"rl_coef": 0.0}},
    },
    knobs=ELKnobs,
)
