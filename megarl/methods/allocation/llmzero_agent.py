"""LLMZero's agents: a rule-based diagnoser of a stage's training dynamics and three proposers of the
next stage's configurations (reconstructed; the paper's agent is an LLM reading metrics and plots).

``diagnose(records)`` reads a stage's metrics.jsonl records and returns pathology flags.
Proposers map (node config, flags) to ``m`` configuration changes, each value taken from the
search space (``space``: override key -> allowed values, in order):

- ``RuleProposer``: the flags' moves first (one step along a key's value list), e.g. truncated
  samples -> longer ``rollout.max_new_tokens``; then single-key neighbours in a fixed order; then
  seeded random configurations.
- ``RandomProposer``: uniform random configurations (seeded by node): with it the search is random
  search.
- ``LLMProposer``: asks a causal LM through a rollout engine for JSON changes; an answer that does
  not parse or leaves the space is replaced by the rule proposer's (counted in ``fallbacks``).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from dataclasses import dataclass
from typing import Any

# pathology thresholds (means over the stage's last `window` steps)
WINDOW = 3


@dataclass(frozen=True)
class Rules:
    """Thresholds of the rule-based diagnoser."""

    entropy_floor: float = 0.3  # train/entropy below: entropy collapse
    kl_ceiling: float = 0.2  # train/kl above: drifting from the reference
    truncated: float = 0.2  # rollout/truncated_frac above: length-limited samples
    zero_var: float = 0.5  # rollout/zero_var_group_frac above: most groups have no gradient
    plateau: float = 0.02  # reward gain (last window minus first window) below: plateau


def _mean_last(records: list[dict], key: str, window: int, first: bool = False) -> float | None:
    vals = [r[key] for r in records if key in r and isinstance(r[key], (int, float))]
    if not vals:
        return None
    part = vals[:window] if first else vals[-window:]
    return sum(part) / len(part)


def diagnose(records: list[dict], rules: Rules | None = None) -> dict[str, bool]:
    """Pathology flags of one stage from its metrics records (missing metrics: flag off)."""
    rules = rules or Rules()

    def above(key: str, limit: float) -> bool:
        v = _mean_last(records, key, WINDOW)
        return v is not None and v > limit

    ent = _mean_last(records, "train/entropy", WINDOW)
    r_first = _mean_last(records, "reward/mean", WINDOW, first=True)
    r_last = _mean_last(records, "reward/mean", WINDOW)
    return {
        "entropy_collapse": ent is not None and ent < rules.entropy_floor,
        "kl_high": above("train/kl", rules.kl_ceiling),
        "truncated": above("rollout/truncated_frac", rules.truncated),
        "zero_var": above("rollout/zero_var_group_frac", rules.zero_var),
        "plateau": r_first is not None and r_last is not None and r_last - r_first < rules.plateau,
    }


# flag -> moves (key, direction along its value list); capacity moves only go up
MOVES: dict[str, list[tuple[str, int]]] = {
    "truncated": [("rollout.max_new_tokens", +1)],
    "zero_var": [("rollout.n", +1)],
    "entropy_collapse": [("rollout.temperature", +1), ("optimizer.lr", -1)],
    "kl_high": [("objective.kl_coef", +1), ("optimizer.lr", -1)],
    "plateau": [("optimizer.lr", +1), ("objective.kl_coef", -1)],
}


def _step(space: dict, config: dict, base: dict, key: str, d: int) -> Any | None:
    """``key``'s value one place along ``space[key]`` from its current one (None at an end)."""
    vals = list(space[key])
    cur = config.get(key, base.get(key, vals[0]))
    i = vals.index(cur) if cur in vals else min(range(len(vals)), key=lambda j: abs(vals[j] - cur))
    j = i + d
    return vals[j] if 0 <= j < len(vals) and vals[j] != cur else None


def random_configs(space: dict, count: int, seed: int, node_id: int) -> list[dict]:
    """``count`` configurations, each key uniform over its values, seeded by (seed, node)."""
    rng = random.Random(seed * 1_000_003 + node_id)
    return [{key: rng.choice(list(vals)) for key, vals in sorted(space.items())} for _ in range(count)]


class RandomProposer:
    """Uniform random configurations: the random-search baseline."""

    def __init__(self, space: dict, seed: int):
        self.space, self.seed = space, seed

    def __call__(self, node: Any, m: int, flags: dict[str, bool] | None = None) -> list[dict]:
        """``m`` random configurations for children of ``node``."""
        return random_configs(self.space, m, self.seed, node.id)


class RuleProposer:
    """Moves named by the diagnosis, then one-key neighbours, then random configurations.
    ``base``: the base config's values of the space keys (where a node does not set them)."""

    def __init__(self, space: dict, base: dict, seed: int):
        self.space, self.base, self.seed = space, base, seed

    def __call__(self, node: Any, m: int, flags: dict[str, bool] | None = None) -> list[dict]:
        """``m`` distinct changes for children of ``node`` (a coordinated change first)."""
        flags = flags or {}
        out: list[dict] = []

        def add(change: dict) -> None:
            if change and change not in out and len(out) < m:
                out.append(change)

        joint: dict = {}  # every flagged move at once: one coordinated multi-key change
        for flag, moves in MOVES.items():
            if flags.get(flag):
                for key, d in moves:
                    v = _step(self.space, node.config, self.base, key, d) if key in self.space else None
                    if v is not None:
                        joint.setdefault(key, v)
                        add({key: v})
        if len(joint) > 1 and out:
            out.insert(0, joint)
            out = out[:m]
        for key in sorted(self.space):
            for d in (+1, -1):
                v = _step(self.space, node.config, self.base, key, d)
                if v is not None:
                    add({key: v})
        extra = 0
        while len(out) < m and extra < 100:
            add(random_configs(self.space, 1, self.seed + extra, node.id)[0])
            extra += 1
        return out


_JSON = re.compile(r"\{[^{}]*\}")


def parse_changes(text: str, space: dict) -> dict | None:
    """The first JSON object in ``text`` whose keys are in ``space`` and values among its values
    (None otherwise)."""
    for m in _JSON.finditer(text):
        try:
            d = json.loads(m.group(0))
        except ValueError:
            continue
        if isinstance(d, dict) and d and all(k in space and v in list(space[k]) for k, v in d.items()):
            return d
    return None


class LLMProposer:
    """Changes written by a causal LM served by ``engine`` (any ``RolloutEngine``); ``tokenizer``
    encodes the prompt and decodes the answers; unusable answers fall back to ``fallback``."""

    def __init__(self, engine: Any, tokenizer: Any, space: dict, fallback: RuleProposer, seed: int):
        self.engine, self.tok, self.space, self.fallback, self.seed = engine, tokenizer, space, fallback, seed
        self.fallbacks = 0
        self.answers = 0

    def prompt(self, node: Any, flags: dict[str, bool]) -> str:
        """The agent's prompt: the diagnosis, the current configuration, the allowed values."""
        seen = [k for k, v in flags.items() if v] or ["none"]
        return (
            "You tune an RL training run. Diagnosis of the last stage: " + ", ".join(seen) + ". "
            f"Current settings: {json.dumps(node.config, sort_keys=True)}. "
            f"Allowed values: {json.dumps(self.space, sort_keys=True)}. "
            "Answer with one JSON object of the settings to change.\n"
        )

    def __call__(self, node: Any, m: int, flags: dict[str, bool] | None = None) -> list[dict]:
        """``m`` changes: the LM's parsed answers, the rule proposer's where an answer is unusable."""
        from megarl.rollout.types import SamplingParams

        flags = flags or {}
        ids = list(self.tok.encode(self.prompt(node, flags)))
        sp = SamplingParams(temperature=1.0, max_new_tokens=96, seed=self.seed * 1_000_003 + node.id)
        res = asyncio.run(self.engine.generate(ids, n=m, sampling=sp))
        rule = self.fallback(node, m, flags)
        out: list[dict] = []
        for i, s in enumerate(res.samples):
            self.answers += 1
            got = parse_changes(self.tok.decode(s.token_ids), self.space)
            if got is None or got in out:
                self.fallbacks += 1
                got = next((r for r in rule[i:] + rule if r not in out), rule[i % len(rule)])
            out.append(got)
        return out
