"""``ShapingProcessor``: the configured ``reward.shaping`` applied to every rollout round (rank 0).

The shapers (one module each) implement ``shape_round(round, env) -> RoundResult`` over the round's
named reward dimensions; this processor builds the shaper from its knobs, gives it a ``ShapingEnv``
(an ``LLMJudge`` over the run's own rollout engine when the shaper declares ``needs_judge``, and the
reward dims of an anchor answer), and adds the metrics every shaper shares. Quickstart stand-ins
(the synthetic digit tasks have no documents, evidence or reference answers) are documented on
each shaper.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megarl.plugin.rounds import RolloutRound, RoundResult
from megarl.rewards.shaping.judge import JudgeTokenizer, LLMJudge
from megarl.rewards.shaping.registry import build_reward_shaping


@dataclass
class ShapingEnv:
    """What a shaper may use besides the round: ``judge`` (an ``LLMJudge`` or None) and
    ``score_anchor(answer) -> {dim: value}`` (the reward dims of ``answer`` scored against itself)."""

    judge: LLMJudge | None
    score_anchor: Callable[[str], dict[str, float]]


def make_judge(ctx: Any) -> LLMJudge:
    """An ``LLMJudge`` over rank 0's rollout engine with the ``reward.judge`` settings; prompts are cut
    to the model's context minus the judge's answer budget."""
    from megarl.rollout.types import SamplingParams

    j = ctx.cfg.reward.judge
    room = int(ctx.hf_config.get("max_position_embeddings", 4096)) - j.max_new_tokens - 1
    return LLMJudge(
        ctx.engine,
        JudgeTokenizer(ctx.tokenizer, room),
        timeout_s=j.timeout_s,
        sampling=SamplingParams(
            temperature=j.temperature, max_new_tokens=j.max_new_tokens, stop_token_ids=(ctx.tokenizer.eos_id,)
        ),
    )


class ShapingProcessor:
    """A ``RoundProcessor`` applying ``reward.shaping`` (see the module docstring)."""

    def __init__(self, ctx: Any, judge: LLMJudge | None = None):
        section = ctx.cfg.reward.shaping
        self.name = section["name"]
        self.shaper = build_reward_shaping({"shaping": section})
        if self.shaper.needs_judge and judge is None:
            if ctx.engine is None:
                raise ValueError(f"reward.shaping.name={self.name!r} needs an LLM judge (the rollout engine)")
            judge = make_judge(ctx)
        self.judge = judge

        def score_anchor(answer: str) -> dict[str, float]:
            return {k: float(v[0]) for k, v in ctx.score([answer], [answer]).dims.items()}

        self.env = ShapingEnv(judge, score_anchor)
        self.shaper.check_weights({f.name: float(f.weight) for f in ctx.cfg.reward.functions})

    async def process(self, r: RolloutRound) -> RoundResult:
        """The shaped scalar rewards of ``r`` and the shaper's diagnostics."""
        out = await self.shaper.shape_round(r, self.env)
        scalar = out.scalar.to(torch.float32)
        out.metrics[f"shaping/{self.name}/changed_frac"] = float((scalar != r.scalar).float().mean())
        if self.judge is not None:
            s = self.judge.stats
            out.metrics.update(
                {
                    "judge/calls": float(s.calls),
                    "judge/malformed": float(s.malformed),
                    "judge/timeouts": float(s.timeouts),
                    "judge/engine_errors": float(s.engine_errors),
                }
            )
        return RoundResult(scalar=scalar, metrics=out.metrics)

    def state_dict(self) -> dict:
        """The shaper's name and state."""
        return {"name": self.name, "shaper": self.shaper.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; a state of another shaper is refused, naming both."""
        if state.get("name") != self.name:
            raise ValueError(
                f"checkpoint shaping state is for {state.get('name')!r}, the config has {self.name!r}"
            )
        self.shaper.load_state_dict(state["shaper"])


def dims_matrix(r: RolloutRound) -> torch.Tensor:
    """The round's reward dimensions as [G * n, K] float64, in ``r.weights`` order."""
    return torch.stack([r.dims[k].double() for k in r.weights], 1)


__all__ = ["ShapingEnv", "ShapingProcessor", "dims_matrix", "make_judge"]
