"""LLMZero's search tree: UCT selection, expansion from proposals, backup, budget (reference/allocation.py
``llmzero_*``).

Nodes are (checkpoint, config) pairs: a node's config is the run's overrides, cumulative from the
root; training a node means one stage of RL from its parent's final weights. ``next_stage`` picks
the node to train next (the root first; then select by UCT, ask for ``k`` proposals when the
selected node has none pending, and create the child from the first one) and refuses a stage that
would take the compute spent past the budget; ``record`` backs the stage's validation value up to
the root. The tree is plain data (``to_dict`` / ``from_dict``), saved after every stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field


@dataclass
class Node:
    """One (checkpoint, config) node; ``value``: its own stage's validation metric (None: not trained)."""

    id: int
    parent: int | None
    depth: int
    config: dict
    children: list[int] = field(default_factory=list)
    pending: list[dict] = field(default_factory=list)
    visits: int = 0
    value_sum: float = 0.0
    value: float | None = None
    done: bool = False
    charged: bool = False  # its stage's cost is counted in ``spent``


class SearchTree:
    """See the module docstring. ``budget``: compute cap (the unit of ``cost``); ``capacity``: keys
    whose value a child never lowers (the capacity prior)."""

    def __init__(self, k: int, c: float, max_depth: int, budget: float, capacity: Sequence[str] = ()):
        self.k, self.c, self.max_depth, self.budget = k, c, max_depth, budget
        self.capacity = tuple(capacity)
        self.nodes: list[Node] = [Node(0, None, 0, {})]
        self.spent = 0.0
        self.clamped = 0  # proposals the capacity prior raised

    def uct(self, node: Node, parent: Node) -> float:
        """``Q + c sqrt(ln N_parent / N)`` (+inf unvisited)."""
        if node.visits == 0:
            return math.inf
        return node.value_sum / node.visits + self.c * math.sqrt(
            math.log(max(parent.visits, 1)) / node.visits
        )

    def expandable(self, node: Node) -> bool:
        return node.depth < self.max_depth and len(node.children) < self.k

    def select(self) -> Node | None:
        """The node to grow: descend by UCT (ties: lowest id) to the first expandable node."""
        node = self.nodes[0]
        while not node.done:
            if self.expandable(node):
                return node
            best, best_score = None, -math.inf
            for i in node.children:
                ch = self.nodes[i]
                if ch.done:
                    continue
                s = self.uct(ch, node)
                if s > best_score:
                    best, best_score = ch, s
            node = best  # a node that is not done has a live child
        return None

    def _with_prior(self, parent: dict, cfg: dict) -> dict:
        out = dict(cfg)
        for key in self.capacity:
            if key in parent and key in out and out[key] < parent[key]:
                out[key] = parent[key]
                self.clamped += 1
        return out

    def next_stage(
        self, propose: Callable[[Node, int], list[dict]], cost: Callable[[dict], float]
    ) -> Node | None:
        """The node to train next (created and charged), or None (tree done or budget reached). A
        node created but not recorded (a search stopped mid-stage) comes back first, charged once."""
        for n in self.nodes:
            if n.value is None:
                if not n.charged:
                    if self.spent + cost(n.config) > self.budget:
                        return None
                    self.spent += cost(n.config)
                    n.charged = True
                return n
        node = self.select()
        if node is None:
            return None
        if not node.pending:
            node.pending = [dict(p) for p in propose(node, self.k - len(node.children))]
            if not node.pending:
                raise ValueError(f"the proposer gave no configuration for node {node.id}")
        cfg = self._with_prior(node.config, {**node.config, **node.pending[0]})
        if self.spent + cost(cfg) > self.budget:
            return None
        node.pending.pop(0)
        child = Node(len(self.nodes), node.id, node.depth + 1, cfg, charged=True)
        self.nodes.append(child)
        node.children.append(child.id)
        self.spent += cost(cfg)
        return child

    def record(self, node: Node, value: float) -> None:
        """The stage's value: set it, back it up to the root, update the done flags."""
        node.value = float(value)
        i: int | None = node.id
        while i is not None:
            n = self.nodes[i]
            n.visits += 1
            n.value_sum += node.value
            full = n.depth >= self.max_depth or len(n.children) >= self.k
            n.done = full and all(self.nodes[j].done for j in n.children)
            i = n.parent

    def best(self) -> Node:
        """The trained node with the highest own value (ties: the shallowest, then lowest id)."""
        trained = [n for n in self.nodes if n.value is not None]
        return max(trained, key=lambda n: (n.value, -n.depth, -n.id))

    def path(self, node: Node) -> list[int]:
        """Node ids from the root to ``node``."""
        out = [node.id]
        while self.nodes[out[-1]].parent is not None:
            out.append(self.nodes[out[-1]].parent)
        return out[::-1]

    def to_dict(self) -> dict:
        """Plain data (JSON)."""
        return {
            "k": self.k,
            "c": self.c,
            "max_depth": self.max_depth,
            "budget": self.budget,
            "capacity": list(self.capacity),
            "spent": self.spent,
            "clamped": self.clamped,
            "nodes": [asdict(n) for n in self.nodes],
        }

    @classmethod
    def from_dict(cls, d: dict) -> SearchTree:
        """Restore ``to_dict()``."""
        t = cls(d["k"], d["c"], d["max_depth"], d["budget"], d["capacity"])
        t.spent, t.clamped = d["spent"], d["clamped"]
        t.nodes = [Node(**n) for n in d["nodes"]]
        return t
