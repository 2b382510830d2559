"""LLMZero: tree search over multi-stage RL training strategies (paper arXiv 2606.18388; the search
rule is the paper's UCT/MCTS, the diagnoser, proposers and bookkeeping are reconstructed).

    python -m megarl.methods.allocation.llmzero examples/methods/llmzero.yaml --out runs/llmzero [K=V ...]

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

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.batch import PackedBatch
from megarl.methods.allocation.llmzero_agent import (
    WINDOW,
    LLMProposer,
    RandomProposer,
    RuleProposer,
    Rules,
    diagnose,
)
from megarl.methods.allocation.llmzero_tree import Node, SearchTree
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodParts, MethodSpec
from megarl.rundir import METRICS, read_metrics

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
    "megarl.methods.allocation.llmzero); in a run: the diagnoser's flags",
    provenance="paper",
    knobs=LLMZeroKnobs,
    build=build,
)


# ------------------------------------------------------------------------------ the driver
def override_args(config: dict) -> list[str]:
    """``section.key=value`` command-line overrides of a node's config."""
    return [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in sorted(config.items())]


class StageRunner:
    """Trains one node as a real ``megarl train`` process (see the module docstring)."""

    def __init__(self, config: Path, out: Path, knobs: LLMZeroKnobs, extra: list[str], python: str = ""):
        self.config, self.out, self.k, self.extra = config, out, knobs, list(extra)
        self.python = python or sys.executable

    def run_dir(self, node: Node) -> Path:
        return self.out / f"node_{node.id:03d}"

    def _call(self, cmd: list[str], log: Path) -> None:
        with open(log, "a") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[2:5])} failed (exit {p.returncode}); see {log}")

    def __call__(self, node: Node, parent: Node | None) -> float:
        """Fork the parent's final weights, train the stage, return its value."""
        rd, S = self.run_dir(node), self.k.stage_steps
        rd.mkdir(parents=True, exist_ok=True)
        log = rd / "stage.log"
        cli = [self.python, "-m", "megarl.cli"]
        if parent is not None and not (rd / "init_policy").is_dir():
            src = str(self.run_dir(parent))
            self._call(
                [*cli, "convert", "megatron-to-hf", "--ckpt", src, "--out", str(rd / "init_policy")], log
            )
        stage = [f"schedule.steps={S}", f"schedule.eval_every={S}", f"checkpoint.every={S}"]
        self._call(
            [*cli, "train", str(self.config), *self.extra, *override_args(node.config), *stage,
             f"logging.run_dir={rd}"],
            log,
        )  # fmt: skip
        recs = [r for r in read_metrics(rd) if self.k.value_metric in r]
        if not recs:
            raise RuntimeError(f"{rd / METRICS}: no {self.k.value_metric!r} record (is eval enabled?)")
        return float(recs[-1][self.k.value_metric])


def make_proposer(knobs: LLMZeroKnobs, base: dict, runner: StageRunner) -> Any:
    """propose(node, m) for the tree: the configured proposer fed with the node's diagnosis."""
    rule = RuleProposer(knobs.space, base, knobs.seed)
    if knobs.proposer == "random":
        agent: Any = RandomProposer(knobs.space, knobs.seed)
    elif knobs.proposer == "llm":
        from megarl.rollout.embedded import EmbeddedEngine

        engine = EmbeddedEngine.from_pretrained(knobs.llm_dir, name="llmzero-agent")
        agent = LLMProposer(engine, engine.tokenizer, knobs.space, rule, knobs.seed)
    else:
        agent = rule

    def propose(node: Node, m: int) -> list[dict]:
        return agent(node, m, diagnose(read_metrics(runner.run_dir(node))))

    return propose


def search(
    tree: SearchTree, runner: Any, propose: Any, cost: Any, save: Any = None, log: Any = print
) -> SearchTree:
    """Train stages until the tree is done or the budget is spent; ``save(tree)`` after each."""
    while True:
        node = tree.next_stage(propose, cost)
        if node is None:
            break
        parent = None if node.parent is None else tree.nodes[node.parent]
        t0 = time.time()
        value = runner(node, parent)
        tree.record(node, value)
        log(
            f"llmzero: node {node.id} (parent {node.parent}, depth {node.depth}) {node.config} -> "
            f"{value:.4f} in {time.time() - t0:.0f}s; spent {tree.spent:g}/{tree.budget:g}"
        )
        if save is not None:
            save(tree)
    return tree


def main(argv: list[str] | None = None) -> int:
    """``python -m megarl.methods.allocation.llmzero CONFIG --out DIR [KEY=VALUE ...]``."""
    import argparse

    import yaml

    ap = argparse.ArgumentParser(prog="python -m megarl.methods.allocation.llmzero", description=__doc__)
    ap.add_argument("config", help="a run config with method: {name: llmzero, ...}")
    ap.add_argument("--out", required=True, help="search directory (node run dirs, tree.json)")
    ap.add_argument(
        "overrides", nargs="*", help="section.key=value for every stage (e.g. schedule.prompts_per_step=8)"
    )
    args = ap.parse_args(argv)
    config, out = Path(args.config).resolve(), Path(args.out)
    raw = yaml.safe_load(config.read_text()) or {}
    section = dict(raw.get("method") or {})
    if section.get("name") != "llmzero":
        print(
            f"{config}: method.name must be llmzero for a search (got {section.get('name')!r})",
            file=sys.stderr,
        )
        return 2
    section.pop("name")
    from megarl.plugin.knobs import build_knobs

    try:
        knobs = build_knobs(LLMZeroKnobs, section, f"{config}: method")
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    state = out / "tree.json"
    if state.exists():
        tree = SearchTree.from_dict(json.loads(state.read_text()))
    else:
        capacity = knobs.capacity if knobs.capacity_prior else []
        tree = SearchTree(knobs.children, knobs.uct_c, knobs.max_depth, knobs.budget_steps, capacity)
    runner = StageRunner(config, out, knobs, args.overrides)
    base = _base_values(config, knobs.space)
    propose = make_proposer(knobs, base, runner)

    def save(t: SearchTree) -> None:
        tmp = state.with_suffix(".tmp")
        tmp.write_text(json.dumps(t.to_dict(), indent=1))
        tmp.replace(state)

    search(tree, runner, propose, lambda cfg: knobs.stage_steps, save)
    best = tree.best()
    where = runner.run_dir(best)
    print(
        f"llmzero: {len(tree.nodes)} nodes, {tree.spent:g}/{tree.budget:g} steps; best node {best.id} "
        f"(path {tree.path(best)}) {knobs.value_metric}={best.value:.4f} {best.config}: {where}"
    )
    return 0


def _layered(path: Path) -> dict:
    """The raw config of ``path`` over its ``base:`` chain (mappings merged, the rest replaced)."""
    import yaml

    d = yaml.safe_load(path.read_text()) or {}
    bases = d.pop("base", None) or []
    out: dict = {}
    for b in [bases] if isinstance(bases, str) else bases:
        out = _merge(out, _layered((path.parent / b).resolve()))
    return _merge(out, d)


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _base_values(config: Path, space: dict) -> dict:
    """The space keys' values the search config sets (its ``base:`` chain included)."""
    raw, out = _layered(config), {}
    for key in space:
        sec, _, name = key.partition(".")
        if isinstance(raw.get(sec), dict) and name in raw[sec]:
            out[key] = raw[sec][name]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
