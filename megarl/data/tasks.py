"""Synthetic verifiable tasks written as jsonl datasets (``data.generate`` in the config).

Each row: ``{"prompt": ..., "answer": ..., "task": ...}``. Tasks:

- ``reverse``: reverse a string of ``digits`` digits: ``"R 4071="`` -> ``"1704"``.
- ``add``: add two numbers of up to ``digits`` digits: ``"25+17="`` -> ``"42"``.
- ``copy``: repeat the digits: ``"C 4071="`` -> ``"4071"``.
- ``grid``: a ``digits`` x ``digits`` board for the grid game (``environment.name: grid``,
  megarl/rollout/grid_env.py): ``"grid 4 at 0,0 goal 2,3 walls 1,1 2,2:"`` -> ``"2,3"`` (the goal).

Train and eval sets are disjoint (eval rows are drawn first and excluded from train).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from megarl.data.grid import random_board


def _reverse(rng: random.Random, digits: int) -> tuple[str, str]:
    s = "".join(rng.choice("0123456789") for _ in range(digits))
    return f"R {s}=", s[::-1]


def _copy(rng: random.Random, digits: int) -> tuple[str, str]:
    s = "".join(rng.choice("0123456789") for _ in range(digits))
    return f"C {s}=", s


def _add(rng: random.Random, digits: int) -> tuple[str, str]:
    a, b = rng.randrange(10**digits), rng.randrange(10**digits)
    return f"{a}+{b}=", str(a + b)


TASKS = {"reverse": _reverse, "add": _add, "copy": _copy, "grid": random_board}


def generate_task_files(
    task: str,
    train_path: str | os.PathLike,
    eval_path: str | os.PathLike,
    num_train: int = 2000,
    num_eval: int = 200,
    digits: int = 3,
    seed: int = 0,
) -> None:
    """Write disjoint train/eval jsonl files for ``task`` (overwrites them)."""
    if task not in TASKS:
        raise ValueError(f"data.generate.task={task!r}; allowed: {', '.join(TASKS)}")
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    budget = (num_train + num_eval) * 50
    while len(rows) < num_train + num_eval and budget > 0:
        budget -= 1
        prompt, answer = TASKS[task](rng, digits)
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "answer": answer, "task": task})
    if len(rows) < num_train + num_eval:
        raise ValueError(
            f"task {task!r} with {digits} digit(s) has fewer than {num_train + num_eval} distinct prompts"
        )
    for path, part in ((eval_path, rows[:num_eval]), (train_path, rows[num_eval:])):
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        # every rank of a job may generate the same files at once: a private temp name per process,
        # then an atomic replace (the contents are identical, so whichever lands last is fine)
        tmp = p.with_name(f"{p.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in part))
        os.replace(tmp, p)
