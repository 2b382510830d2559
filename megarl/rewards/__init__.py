"""Rewards: built-in verifiers (exact match, regex), user functions by import path run in a
contained worker process (timeout + fallback), several named dimensions per sample.

Nothing heavy is imported here: the contained worker imports ``megarl.rewards.sandbox`` and must
start fast (no torch).
"""

__all__ = ["ContainedFunction", "RewardComputer", "RewardResult", "exact_match", "regex_match"]


def __getattr__(name):
    if name in ("exact_match", "regex_match"):
        from megarl.rewards import builtin

        return getattr(builtin, name)
    if name in ("RewardComputer", "RewardResult"):
        from megarl.rewards import compute

        return getattr(compute, name)
    if name == "ContainedFunction":
        from megarl.rewards.sandbox import ContainedFunction

        return ContainedFunction
    raise AttributeError(name)
