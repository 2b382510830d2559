"""LLMZero's driver: each node of the search tree is a real ``megarl train`` stage (llmzero.py).

    python -m megarl.methods.allocation.llmzero_driver examples/methods/llmzero.yaml --out runs/lz

``K=V`` overrides go to every stage's run; ``method.<knob>=value`` also sets the search's own
knobs. A stage: ``megarl convert megatron-to-hf`` of the parent's last checkpoint into the node's
``init_policy`` (the root: the config's own warm-up), then ``megarl train`` for ``stage_steps`` steps
with the node's overrides, evaluated at its last step. ``<out>/tree.json`` is written after every
stage; the same command continues a stopped search.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from megarl.methods.allocation.llmzero import LLMZeroKnobs
from megarl.methods.allocation.llmzero_agent import LLMProposer, RandomProposer, RuleProposer, diagnose
from megarl.methods.allocation.llmzero_tree import Node, SearchTree
from megarl.rundir import METRICS, read_metrics


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
    """``python -m megarl.methods.allocation.llmzero_driver CONFIG --out DIR [KEY=VALUE ...]``."""
    import argparse

    import yaml

    ap = argparse.ArgumentParser(
        prog="python -m megarl.methods.allocation.llmzero_driver", description=__doc__
    )
    ap.add_argument("config", help="a run config with method: {name: llmzero, ...}")
    ap.add_argument("--out", required=True, help="search directory (node run dirs, tree.json)")
    ap.add_argument(
        "overrides", nargs="*", help="section.key=value for every stage (e.g. schedule.prompts_per_step=8)"
    )
    args = ap.parse_intermixed_args(argv)
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
    for ov in args.overrides:  # method.<knob>=value sets the search's own knobs too
        key, eq, val = ov.partition("=")
        if eq and key.startswith("method.") and key != "method.name":
            section[key[len("method.") :]] = yaml.safe_load(val)
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
