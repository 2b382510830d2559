"""LLM-judge calls through the rollout engine interface, with timeouts and containment.

``LLMJudge(engine, tokenizer)`` renders a prompt, generates with any ``RolloutEngine`` (vLLM, SGLang,
embedded), decodes and parses the reply. Every failure is contained per call: a timeout, an engine
error or a reply the parser cannot read gives ``JudgeResult(value=None, error=...)`` and is counted,
so one bad judge reply never takes down a reward batch. Callers decide the fallback value.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megarl.rollout.engine import RolloutEngine
from megarl.rollout.types import RolloutError, SamplingParams

_NUMBER = r"[-+]?(?:\d+\.\d*|\.\d+|\d+)"


class MalformedJudgeOutput(ValueError):
    """The judge's reply could not be parsed; the message quotes the start of the reply."""


def parse_score(text: str, lo: float = 0.0, hi: float = 1.0) -> float:
    """The number after the last ``score:`` (case-insensitive), else the last number of the reply;
    it must lie in [lo, hi]."""
    m = re.findall(rf"score\s*[:=]\s*({_NUMBER})", text, flags=re.IGNORECASE) or re.findall(_NUMBER, text)
    if not m:
        raise MalformedJudgeOutput(f"no score in judge reply {text[:80]!r}")
    v = float(m[-1])
    if not lo <= v <= hi:
        raise MalformedJudgeOutput(f"score {v} outside [{lo}, {hi}] in judge reply {text[:80]!r}")
    return v


def parse_verdicts(text: str, k: int) -> list[int]:
    """``k`` yes/no verdicts (lines like ``1: yes``/``2. no``; 1/0 and true/false accepted) -> [k] 0/1."""
    found: dict[int, int] = {}
    for m in re.finditer(r"(\d+)\s*[:.)\-]\s*(yes|no|true|false|1|0)\b", text, flags=re.IGNORECASE):
        idx, word = int(m.group(1)), m.group(2).lower()
        found.setdefault(idx, int(word in ("yes", "true", "1")))
    missing = [i for i in range(1, k + 1) if i not in found]
    if missing:
        raise MalformedJudgeOutput(f"judge reply has no verdict for item(s) {missing}: {text[:80]!r}")
    return [found[i] for i in range(1, k + 1)]


def parse_preference(text: str) -> float:
    """P(first ≻ second) from a reply naming ``A`` or ``B`` (``winner: A``) or giving a probability."""
    m = re.search(r"winner\s*[:=]\s*([AB])\b", text, flags=re.IGNORECASE)
    if m:
        return 1.0 if m.group(1).upper() == "A" else 0.0
    return parse_score(text, 0.0, 1.0)


@dataclass
class JudgeResult:
    value: Any = None
    text: str = ""
    error: str | None = None  # None | "timeout" | "engine: ..." | "malformed: ..."


@dataclass
class JudgeStats:
    calls: int = 0
    timeouts: int = 0
    engine_errors: int = 0
    malformed: int = 0
    examples: list = field(default_factory=list)  # first few failure messages

    def note(self, kind: str, msg: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.examples) < 5:
            self.examples.append(msg)


class LLMJudge:
    """Judge calls through a rollout engine. ``tokenizer`` needs ``encode(text)``/``decode(ids)``
    (a HF tokenizer works); ``timeout_s`` bounds each call, ``sampling`` defaults to greedy."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        timeout_s: float = 30.0,
        sampling: SamplingParams | None = None,
        max_concurrency: int = 16,
    ):
        self.engine, self.tok, self.timeout_s = engine, tokenizer, timeout_s
        self.sampling = sampling or SamplingParams(temperature=0.0, max_new_tokens=64)
        self.stats = JudgeStats()
        self._sem = asyncio.Semaphore(max(1, max_concurrency))

    def _encode(self, text: str) -> list[int]:
        try:
            return list(self.tok.encode(text, add_special_tokens=False))
        except TypeError:
            return list(self.tok.encode(text))

    async def ask(self, prompt: str, parse: Callable[[str], Any]) -> JudgeResult:
        """One contained judge call: generate, decode, parse."""
        self.stats.calls += 1
        try:
            async with self._sem:
                res = await asyncio.wait_for(
                    self.engine.generate(self._encode(prompt), n=1, sampling=self.sampling), self.timeout_s
                )
        except TimeoutError:
            self.stats.note("timeouts", f"timeout after {self.timeout_s}s")
            return JudgeResult(error="timeout")
        except RolloutError as e:
            self.stats.note("engine_errors", str(e))
            return JudgeResult(error=f"engine: {e}")
        text = self.tok.decode(res.samples[0].token_ids)
        try:
            return JudgeResult(value=parse(text), text=text)
        except (MalformedJudgeOutput, ValueError) as e:
            self.stats.note("malformed", str(e))
            return JudgeResult(text=text, error=f"malformed: {e}")

    async def ask_many(self, prompts: Sequence[str], parse: Callable[[str], Any]) -> list[JudgeResult]:
        """Contained calls for many prompts, concurrently (the engine's own bound applies too)."""
        return list(await asyncio.gather(*(self.ask(p, parse) for p in prompts)))

    def ask_many_sync(self, prompts: Sequence[str], parse: Callable[[str], Any]) -> list[JudgeResult]:
        """``ask_many`` from synchronous code (runs its own event loop)."""
        return asyncio.run(self.ask_many(prompts, parse))


class JudgeTokenizer:
    """The policy's tokenizer for judge prompts: characters it cannot encode are dropped (a
    character-level tiny model cannot read English; the judge plumbing still runs end to end) and
    the prompt keeps its first token (BOS) and its last ``max_prompt_tokens - 1`` tokens."""

    def __init__(self, tok: Any, max_prompt_tokens: int):
        self.tok, self.max_prompt_tokens = tok, max(2, max_prompt_tokens)

    def encode(self, text: str, **_: Any) -> list[int]:
        """Token ids of ``text`` (unencodable characters dropped, cut to the budget)."""
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
            ids = ids[:1] + ids[-(self.max_prompt_tokens - 1) :]
        return ids

    def decode(self, ids: list[int]) -> str:
        """The policy tokenizer's decoding."""
        return self.tok.decode(list(ids))
