"""The trainer side of ``reward.shaping``: apply the configured shaper to each rollout batch (rank 0).

The shapers themselves live in megarl/rewards/shaping (formulas, state); this module maps the
trainer's rewards onto their inputs. The named reward dimensions of ``reward.functions`` are the
reward vector (AMRP), the rubric (Rubric Dropout: one criterion per dimension, weighted by its
``weight``; CARE: the initial rubric of every prompt) and the correctness signal (CEDAR: the first
dimension, correct when >= 1). LLM-judged shapers (CEDAR's coverage and directionality, CARE's
preference, evolver and new-criterion scores) call an ``LLMJudge`` over the run's own rollout engine.

Quickstart stand-ins (the synthetic digit tasks have no documents, evidence or reference answers):
the reward floor's source text is the prompt (words: alphanumeric runs); CEDAR's evidence items are the prompt's distinct
digits; CARE's anchor response y* is the ground-truth answer.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class JudgeTokenizer:
    """The policy's tokenizer for judge prompts: characters it cannot encode are dropped (a
    character-level tiny model cannot read English; the judge plumbing still runs end to end) and
    the prompt keeps its first token (BOS) and its last ``max_prompt_tokens - 1`` tokens."""

    def __init__(self, tok: Any, max_prompt_tokens: int):
        self.tok, self.max_prompt_tokens = tok, max(2, max_prompt_tokens)

    def encode(self, text: str, **_: Any) -> list[int]:
        try:
            ids = list(self.tok.encode(text))
        except ValueError:
            kept = []
            for c in text:
                try:
                    self.tok.encode(c, bos=False)
                    kept.append(c)
                except ValueError:
                    pass
            ids = list(self.tok.encode("".join(kept)))
        if len(ids) > self.max_prompt_tokens:
            ids = ids[:1] + ids[-(self.max_prompt_tokens - 1):]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids))


@dataclass
class RoundRewards:
    """One rollout round on rank 0: ``n`` samples per prompt, prompts in order."""

    prompts: list[str]  # [G]
    answers: list[str]  # [G]
    uids: list[int]  # [G] stable prompt ids (dataset row index)
    texts: list[str]  # [G * n] decoded responses
    dims: dict[str, torch.Tensor]  # name -> [G * n]
    scalar: torch.Tensor  # [G * n] weighted sum of dims
    n: int


@dataclass
class ShapedRewards:
    scalar: torch.Tensor  # [G * n] the rewards the advantages see
    metrics: dict[str, float] = field(default_factory=dict)


def words(text: str) -> str:
    """``text`` with every run of non-alphanumeric characters turned into one space (the reward
    floor compares words: ``"R 407="`` -> ``"R 407"``, so copying the operand is a copy)."""
    return " ".join(re.findall(r"\w+", text))


def evidence_items(prompt: str) -> list[str]:
    """Quickstart stand-in for CEDAR's evidence: the prompt's distinct digits, in order."""
    return list(dict.fromkeys(re.findall(r"\d", prompt)))


class RewardShaping:
    """``shape(round, step) -> ShapedRewards`` for the configured ``reward.shaping``.

    ``run``: runs a coroutine to completion (the trainer's event loop); ``judge``: an ``LLMJudge``
    or None (needed by ``cedar`` and ``care``); ``score_anchor``: reward dims of (answer, answer),
    used as CARE's anchor scores on the initial criteria.
    """

    def __init__(self, cfg, run: Callable[[Awaitable], Any], judge: Any | None = None,
                 score_anchor: Callable[[str], dict[str, float]] | None = None):
        from megarl.rewards.shaping import build_reward_shaping

        self.name = cfg.reward.shaping["name"]
        self.shaper = build_reward_shaping({"shaping": cfg.reward.shaping})
        self.weights = {f.name: float(f.weight) for f in cfg.reward.functions}
        self.run, self.judge, self.score_anchor = run, judge, score_anchor
        if self.name in ("cedar", "care") and judge is None:
            raise ValueError(f"reward.shaping.name={self.name!r} needs an LLM judge (the rollout engine)")
        if self.name == "care" and any(w < 0 for w in self.weights.values()):
            raise ValueError("reward.shaping.name='care': reward.functions weights must be >= 0 (rubric weights)")

    def _matrix(self, r: RoundRewards) -> torch.Tensor:
        return torch.stack([r.dims[k].double() for k in self.weights], 1)  # [B, K]

    def shape(self, r: RoundRewards, step: int) -> ShapedRewards:
        """Shaped scalar rewards of one round (same order as ``r.texts``) and diagnostics."""
        fn = getattr(self, f"_{self.name}", None)
        if fn is None:
            raise ValueError(f"reward.shaping.name={self.name!r} is not wired into the trainer")
        out = fn(r, step)
        out.scalar = out.scalar.to(torch.float32)
        out.metrics[f"shaping/{self.name}/changed_frac"] = float((out.scalar != r.scalar).float().mean())
        if self.judge is not None:
            s = self.judge.stats
            out.metrics.update({"judge/calls": float(s.calls), "judge/malformed": float(s.malformed),
                                "judge/timeouts": float(s.timeouts), "judge/engine_errors": float(s.engine_errors)})
        return out

    # ------------------------------------------------------------------------- one per shaper
    def _reward_floor(self, r: RoundRewards, step: int) -> ShapedRewards:
        sources = [words(p) for p in r.prompts for _ in range(r.n)]
        shaped, copied = self.shaper(r.scalar, [words(t) for t in r.texts], sources)
        return ShapedRewards(shaped, {"shaping/reward_floor/copied_frac": float(copied.float().mean())})

    def _amrp(self, r: RoundRewards, step: int) -> ShapedRewards:
        shaped = self.shaper(self._matrix(r))
        w = self.shaper.weights
        return ShapedRewards(shaped, {f"shaping/amrp/w/{k}": float(w[i]) for i, k in enumerate(self.weights)})

    def _rubric_dropout(self, r: RoundRewards, step: int) -> ShapedRewards:
        scores = self._matrix(r)
        weights = torch.tensor(list(self.weights.values()), dtype=torch.float64).expand_as(scores)
        valid = torch.ones_like(scores, dtype=torch.bool)
        uids = torch.tensor([u for u in r.uids for _ in range(r.n)])
        shaped = self.shaper(scores, weights, valid, uids, step)
        kept = self.shaper.kept_criteria(valid, uids, step, weights)
        return ShapedRewards(shaped, {"shaping/rubric_dropout/kept_frac": float(kept.double().mean())})

    def _cedar(self, r: RoundRewards, step: int) -> ShapedRewards:
        first = next(iter(self.weights))
        correct = (r.dims[first] >= 1.0).double()
        evidence = [evidence_items(p) for p in r.prompts for _ in range(r.n)]
        covered, valid, direction = self.run(self.shaper.judge_inputs(self.judge, r.texts, evidence))
        shaped = self.shaper(correct, covered, valid, direction)
        m = valid.double()
        cov = float(((covered * m).sum(1) / m.sum(1).clamp(min=1)).mean())
        return ShapedRewards(shaped, {"shaping/cedar/coverage": cov, "shaping/cedar/direction": float(direction.mean())})

    def _care(self, r: RoundRewards, step: int) -> ShapedRewards:
        names = list(self.weights)
        K0 = len(names)
        base = self._matrix(r)
        out = torch.zeros(len(r.texts), dtype=torch.float64)
        branches: dict[str, int] = {}
        for g, (prompt, answer, uid) in enumerate(zip(r.prompts, r.answers, r.uids)):
            if uid not in self.shaper.rubrics:
                self.shaper.add_prompt(uid, names, [self.weights[k] for k in names], anchor=answer)
            rub = self.shaper.rubrics[uid]
            sl = slice(g * r.n, (g + 1) * r.n)
            texts = r.texts[sl]
            anchor_dims = self.score_anchor(answer)
            extra = rub.criteria[K0:]  # criteria the evolver added: scored by the judge (0 when it fails)
            scores = torch.cat([base[sl], self._judged(prompt, extra, texts)], 1)
            anchor = torch.cat([torch.tensor([anchor_dims[k] for k in names], dtype=torch.float64),
                                self._judged(prompt, extra, [answer])[0]])
            out[sl] = self.shaper.reward(uid, scores)
            b = self.run(self.shaper.evolve(uid, prompt, texts, scores, anchor, self.judge))
            branches[b] = branches.get(b, 0) + 1
        m = {f"shaping/care/branch_{k}": float(v) for k, v in branches.items()}
        m["shaping/care/criteria_mean"] = float(sum(len(self.shaper.rubrics[u].criteria) for u in r.uids) / len(r.uids))
        return ShapedRewards(out, m)

    def _judged(self, prompt: str, criteria: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        """[len(responses), len(criteria)] judge scores in [0, 1] (0 where a call fails)."""
        from megarl.rewards.shaping.care import CRITERION_PROMPT
        from megarl.rewards.shaping.judge import parse_score

        if not criteria:
            return torch.zeros(len(responses), 0, dtype=torch.float64)
        res = self.run(self.judge.ask_many([CRITERION_PROMPT.format(prompt=prompt, criterion=c, response=y)
                                            for y in responses for c in criteria], parse_score))
        vals = [x.value if x.error is None else 0.0 for x in res]
        return torch.tensor(vals, dtype=torch.float64).view(len(responses), len(criteria))

    # ------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        return {"name": self.name, "shaper": self.shaper.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"checkpoint shaping state is for {state.get('name')!r}, the config has {self.name!r}")
        self.shaper.load_state_dict(state["shaper"])
