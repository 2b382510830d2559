"""LLMZero: tree search over multi-stage RL training strategies (paper arXiv 2606.18388; the search
rule is the paper's UCT/MCTS, the diagnoser, proposers and bookkeeping are reconstructed).

    python -m megarl.methods.allocation.llmzero_driver examples/methods/llmzero.yaml --out runs/lz

A search config is a run config whose ``method`` section is ``llmzero`` with the search's knobs.
Each node of the tree is one stage: ``stage_steps`` RL steps of that config, with the node's
overrides, started from its parent's final weights (``megarl convert megatron-to-hf`` of the
parent's last checkpoint into the child's ``init_policy``; the root starts from the config's own
warm-up). A stage's value is ``value_metric`` at its last step (a held-out evaluation). The
search (llmzero_tree.py) selects by UCT, expands a node with ``children`` proposals from the
diagnosis of its stage (llmzero_agent.py) and backs values up, while the next stage fits
``budget_steps``. The tree is saved to ``<out>/tree.json`` after every stage; running the command
again continues the search (a stage killed mid-way continues from its own checkpoints).

Inside each stage's run the method adds one step hook that logs the train-side pathology flags
(``llmzero/entropy_collapse``, ``llmzero/kl_high``) every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megarl.batch import PackedBatch
from megarl.methods.allocation.llmzero_agent import (
    WINDOW,
    Rules,
    diagnose,
)
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodParts, MethodSpec

PROPOSERS = ("rule", "random", "llm")


def _default_space() -> dict:
    return {
        "optimizer.lr": [1.0e-4, 3.0e-4, 1.0e-3],
        "objective.kl_coef": [0.0, 0.001, 0.01],
        "rollout.temperature": [0.8, 1.0, 1.2],
        "rollout.max_new_tokens": [6, 8, 12],
    }


@dataclass
class LLMZeroKnobs(Knobs):
    """The search (``method`` section of a search config)."""

    stage_steps: int = 5  # RL steps per node (one stage)
    children: int = 2  # proposals per expanded node (k)
    uct_c: float = 0.5  # UCT exploration constant
    budget_steps: int = 30  # compute cap: RL steps over all stages
    max_depth: int = 3  # stages after the root on one path
    proposer: str = "rule"  # rule | random | llm
    llm_dir: str = ""  # proposer llm: HF directory of the agent's causal LM (with its tokenizer)
    space: dict = field(default_factory=_default_space)  # override key -> allowed values, in order
    capacity: list = field(default_factory=lambda: ["rollout.max_new_tokens", "rollout.n"])
    capacity_prior: bool = True  # children never lower a capacity key
    value_metric: str = "eval/sampled_acc"  # a stage's value: this metric at its last step
    seed: int = 0

    def check(self) -> None:
        """Positive sizes, a known proposer, a well-formed space."""
        for key in ("stage_steps", "children", "budget_steps", "max_depth"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if self.uct_c < 0:
            raise ValueError(f"uct_c={self.uct_c} must be >= 0")
        if self.proposer not in PROPOSERS:
            raise ValueError(f"proposer={self.proposer!r}; allowed: {', '.join(PROPOSERS)}")
        if self.proposer == "llm" and not self.llm_dir:
            raise ValueError("proposer=llm needs llm_dir (the agent model's HF directory)")
        if not isinstance(self.space, dict) or not self.space:
            raise ValueError("space must be a mapping of override keys (section.key) to lists of values")
        for key, vals in self.space.items():
            if "." not in key:
                raise ValueError(f"space.{key}: not an override key (section.key)")
            if not isinstance(vals, list) or not vals:
                raise ValueError(f"space.{key} must be a non-empty list of values, got {vals!r}")


# ------------------------------------------------------------------------------ inside a stage's run
class StageDiagnosis:
    """Step hook: the diagnoser's train-side flags over the last steps, logged every step."""

    def __init__(self, rules: Rules | None = None):
        self.rules = rules or Rules()
        self.recent: list[dict] = []

    def before_train(self, step: int, batch: PackedBatch) -> PackedBatch:
        return batch

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        """The flags of the last ``WINDOW`` steps' train metrics."""
        keep = {k: v for k, v in metrics.items() if k in ("train/entropy", "train/kl")}
        self.recent = [*self.recent, keep][-WINDOW:]
        flags = diagnose(self.recent, self.rules)
        return {f"llmzero/{k}": float(flags[k]) for k in ("entropy_collapse", "kl_high")}

    def state_dict(self) -> dict:
        return {"recent": [dict(r) for r in self.recent]}

    def load_state_dict(self, state: dict) -> None:
        self.recent = [dict(r) for r in state["recent"]]


def build(ctx: Any, knobs: LLMZeroKnobs) -> MethodParts:
    """A run with this method trains as its config says and logs the diagnoser's flags."""
    return MethodParts(step_hooks=[StageDiagnosis()])


SPEC = MethodSpec(
    name="llmzero",
    summary="tree search over training-strategy stages from checkpoints (driver: python -m "
    "megarl.methods.allocation.llmzero_driver); in a run: the diagnoser's flags",
    provenance="paper",
    knobs=LLMZeroKnobs,
    build=build,
)
