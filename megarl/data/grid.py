"""Boards of the grid game (megarl/rollout/grid_env.py): their prompt format, shortest-path
distances, and random boards for ``data.generate: {task: grid}``.

A board prompt reads ``grid N at r,c goal r,c walls r,c r,c ...:`` (an N x N board, cells
``row,col`` from ``0,0`` at the top left; ``walls`` optional).
"""

from __future__ import annotations

import random
import re
from collections import deque

Cell = tuple[int, int]
STEPS: dict[str, Cell] = {"u": (-1, 0), "d": (1, 0), "l": (0, -1), "r": (0, 1)}
_CELL = r"(\d+),(\d+)"
_BOARD = re.compile(rf"grid (\d+) at {_CELL} goal {_CELL}(?: walls((?: {_CELL})*))?")


def parse_board(prompt: str) -> tuple[int, Cell, Cell, frozenset[Cell]]:
    """(size, start, goal, walls) of a board prompt; ``ValueError`` naming the prompt when it is not one."""
    m = _BOARD.search(prompt)
    if m is None:
        raise ValueError(f"grid board: prompt {prompt!r} is not 'grid N at r,c goal r,c [walls r,c ...]'")
    size = int(m.group(1))
    start, goal = (int(m.group(2)), int(m.group(3))), (int(m.group(4)), int(m.group(5)))
    walls = frozenset((int(a), int(b)) for a, b in re.findall(_CELL, m.group(6) or ""))
    for name, c in [("start", start), ("goal", goal), *[("wall", w) for w in sorted(walls)]]:
        if not (0 <= c[0] < size and 0 <= c[1] < size):
            raise ValueError(f"grid board: prompt {prompt!r}: {name} {c[0]},{c[1]} is off the board")
    if start in walls or goal in walls:
        raise ValueError(f"grid board: prompt {prompt!r}: the start or the goal is a wall")
    return size, start, goal, walls


def distances(size: int, goal: Cell, walls: frozenset[Cell]) -> dict[Cell, int]:
    """Shortest-path distance to ``goal`` of every cell that can reach it (breadth-first)."""
    dist, queue = {goal: 0}, deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in STEPS.values():
            n = (r + dr, c + dc)
            if 0 <= n[0] < size and 0 <= n[1] < size and n not in walls and n not in dist:
                dist[n] = dist[(r, c)] + 1
                queue.append(n)
    return dist


def random_board(rng: random.Random, size: int) -> tuple[str, str]:
    """A board prompt and its goal cell (the row's answer): start and goal distinct, ``size - 1``
    walls elsewhere, the goal reachable from the start."""
    if size < 2:
        raise ValueError(f"grid board: size {size} < 2 has no room for a start and a goal")
    cells = [(r, c) for r in range(size) for c in range(size)]
    while True:
        start, goal, *walls = rng.sample(cells, size + 1)
        if start in distances(size, goal, frozenset(walls)):
            break
    w = "".join(f" {r},{c}" for r, c in sorted(walls))
    return f"grid {size} at {start[0]},{start[1]} goal {goal[0]},{goal[1]} walls{w}:", f"{goal[0]},{goal[1]}"
