"""A text game with state and per-turn rewards: walk a small grid to its goal
(``environment.name: grid``).

A prompt describes one board (megarl/data/grid.py; ``data.generate: {task: grid}`` writes such rows)::

    grid 4 at 0,0 goal 2,3 walls 1,1 2,2:

``grid N``: an N x N board, cells ``row,col`` from ``0,0`` (top left); ``at``: the start cell;
``goal``: the target; ``walls``: blocked cells (optional). The row's answer is the goal cell. Each
turn the model writes one move, ``U``, ``D``, ``L`` or ``R`` (up/down/left/right also read; case
does not matter) and the game answers with its new cell (`` at 1,0:``). A move into a wall or off
the board leaves it where it was (`` blocked at 0,0:``); a turn that is not a move gets an
observation naming the error (`` error: 'x' is not a move (U D L R) at 0,0:``), never an
exception. The episode ends at the goal (`` goal!``) or after ``environment.max_turns`` turns.

Rewards: each turn earns ``progress_reward`` times the decrease of the shortest-path distance to
the goal (potential-based shaping: it sums to ``progress_reward * (d_start - d_end)`` over an
episode whatever the path), plus 1 on the turn that reaches the goal. These per-turn rewards reach
the batch as ``extras["turn_rewards"]`` [B, S] (one per assistant turn). The run's rewards score the
final cell (``row,col``, the environment's ``last_text``) against the row's answer, so
``exact_match`` is 1 exactly when the goal was reached.
"""

from __future__ import annotations

from typing import Any

from megarl.data.grid import STEPS, distances, parse_board
from megarl.rollout.environments import StepResult
from megarl.rollout.tool_env import encode_observation
from megarl.rollout.workflow import WORKFLOWS, EpisodeWorkflow

_WORDS = {"up": "u", "down": "d", "left": "l", "right": "r"}


def read_move(text: str) -> str | None:
    """The move a turn's text names (``u``/``d``/``l``/``r``), or None when it is not exactly one move."""
    t = text.strip().lower().rstrip(".")
    t = _WORDS.get(t, t)
    return t if t in STEPS else None


class GridGame:
    """One board as a multi-turn environment over token ids (see the module docstring)."""

    def __init__(self, tokenizer: Any, prompt: str, max_turns: int = 8, progress_reward: float = 0.1):
        self.tok, self.prompt, self.max_turns = tokenizer, prompt, max_turns
        self.progress_reward = progress_reward
        self.size, self.start, self.goal, self.walls = parse_board(prompt)
        self.dist = distances(self.size, self.goal, self.walls)
        self.pos, self.turn = self.start, 0
        self.last_text = self._cell()

    def _cell(self) -> str:
        return f"{self.pos[0]},{self.pos[1]}"

    def _d(self, cell: tuple[int, int]) -> int:
        return self.dist.get(cell, self.size * self.size)  # a cell cut off from the goal: farther than any

    def reset(self, seed: int | None = None) -> list[int]:
        """Start an episode at the start cell: the prompt's token ids."""
        self.pos, self.turn = self.start, 0
        self.last_text = self._cell()
        return list(self.tok.encode(self.prompt))

    def step(self, action_ids: list[int]) -> StepResult:
        """Apply the turn's move; observe the new cell or the error; reward progress (+1 at the goal)."""
        self.turn += 1
        text = self.tok.decode(list(action_ids))
        move, before = read_move(text), self.pos
        if move is None:
            shown = text.strip()[:20]
            obs = f" error: '{shown}' is not a move (U D L R) at {self._cell()}:"
        else:
            n = (self.pos[0] + STEPS[move][0], self.pos[1] + STEPS[move][1])
            if 0 <= n[0] < self.size and 0 <= n[1] < self.size and n not in self.walls:
                self.pos = n
                obs = f" at {self._cell()}:"
            else:
                obs = f" blocked at {self._cell()}:"
        self.last_text = self._cell()
        reward = self.progress_reward * (self._d(before) - self._d(self.pos))
        reached = self.pos == self.goal
        if reached:
            reward, obs = reward + 1.0, " goal!"
        done = reached or self.turn >= self.max_turns
        info = {"move": move, "cell": self.pos}
        return StepResult(encode_observation(self.tok, obs), reward, done, info)


class GridWorkflow(EpisodeWorkflow):
    """``n`` ``GridGame`` episodes per board prompt."""

    def make_env(self, prompt: str, answer: str) -> GridGame:
        """A ``GridGame`` on the board ``prompt`` describes."""
        return GridGame(self.ctx.tokenizer, prompt, self.ctx.env.max_turns)


WORKFLOWS.add("grid", GridWorkflow)
