"""REWARD_SHAPERS: reward shaping/aggregation steps by name, built from the config's ``reward.shaping``.

Each entry is a class built from keyword knobs (``cls(**knobs)``; unknown or ill-typed knobs raise
naming the key) with ``state_dict()``/``load_state_dict()`` for checkpoints. What a shaper is called
with depends on the method (texts, reward vectors, rubric scores): see each module.
"""

from __future__ import annotations

from typing import Any

from megarl.plugin.knobs import check_call_knobs
from megarl.registry import Registry

REWARD_SHAPERS: Registry = Registry("reward_shaper")


def build_reward_shaping(reward_section: dict) -> Any:
    """The shaper described by a config's ``reward:`` section (``shaping: {name: ..., <knobs>}``), or
    None when the section has no ``shaping`` key. Errors name the offending key."""
    if not isinstance(reward_section, dict):
        raise ValueError(f"reward must be a mapping, got {type(reward_section).__name__}")
    spec = reward_section.get("shaping")
    if spec is None:
        return None
    if not isinstance(spec, dict) or "name" not in spec:
        raise ValueError(f"reward.shaping must be a mapping with 'name', got {spec!r}")
    if spec["name"] not in REWARD_SHAPERS:
        raise ValueError(
            f"reward.shaping.name={spec['name']!r}; allowed: {', '.join(REWARD_SHAPERS.names())}"
        )
    cls = REWARD_SHAPERS.get(spec["name"])
    knobs = {k: v for k, v in spec.items() if k != "name"}
    check_call_knobs(cls.__init__, knobs, "reward.shaping", repr(spec["name"]), skip=("self",))
    return cls(**knobs)
