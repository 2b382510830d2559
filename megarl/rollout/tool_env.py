"""A tool-use environment and its rollout workflow (``environment.name: tools``).

Each turn the model either calls tools (``<tool_call>`` blocks, megarl/rollout/tool_calls.py) and
gets their results back as a ``<tool_response>`` observation, or answers: a turn without a tool
call is the final answer, scored by the run's rewards (reward 1 when correct). Malformed calls,
unknown tools and bad arguments get an observation naming the error, never an exception. The
episode runner (megarl/rollout/environments.py) appends the sampled token ids and the observation
ids as they are (no re-tokenisation); only model tokens are in the loss.

Tools: ``calculator`` (``{"expression": "..."}``, megarl/rollout/calculator.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megarl.rollout.calculator import run_contained
from megarl.rollout.environments import StepResult
from megarl.rollout.tool_calls import ToolCall, format_tool_response, parse_tool_calls
from megarl.rollout.workflow import WORKFLOWS, EpisodeWorkflow


def _calculator(args: dict) -> str:
    expr = args.get("expression")
    if not isinstance(expr, str):
        return "error: calculator needs the argument 'expression' (a string)"
    return run_contained(expr)


TOOLS: dict[str, Callable[[dict], str]] = {"calculator": _calculator}


def _encode(tok: Any, text: str) -> list[int]:
    try:
        return list(tok.encode(text, bos=False))  # megarl's char tokenizer
    except TypeError:
        return list(tok.encode(text, add_special_tokens=False))  # a HF tokenizer


def _encodable(tok: Any, ch: str) -> bool:
    try:
        _encode(tok, ch)
    except ValueError:
        return False
    return True


def encode_observation(tok: Any, text: str) -> list[int]:
    """Token ids of an observation, without special tokens. Characters a closed-alphabet tokenizer
    cannot encode (a tool's error text may hold any) are dropped rather than failing the episode."""
    try:
        return _encode(tok, text)
    except ValueError:
        return _encode(tok, "".join(ch for ch in text if _encodable(tok, ch)))


def run_tool(call: ToolCall, tools: dict[str, Callable[[dict], str]]) -> str:
    """The result text of one call, or the error that stopped it."""
    if call.error:
        return f"error: {call.error}"
    if call.name not in tools:
        return f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(tools))}"
    return tools[call.name](call.arguments)


class ToolTask:
    """One prompt as a tool-use episode (see the module docstring). ``score(text) -> (reward,
    correct)`` scores a final answer."""

    def __init__(
        self,
        tokenizer: Any,
        prompt: str,
        score: Callable[[str], tuple[float, bool]],
        max_turns: int = 3,
        tools: dict[str, Callable[[dict], str]] | None = None,
    ):
        self.tok, self.prompt, self.score, self.max_turns = tokenizer, prompt, score, max_turns
        self.tools = TOOLS if tools is None else tools
        self.turn, self.last_text, self.calls = 0, "", 0

    def reset(self, seed: int | None = None) -> list[int]:
        """Start an episode: the prompt's token ids."""
        self.turn, self.last_text, self.calls = 0, "", 0
        return list(self.tok.encode(self.prompt))

    def step(self, action_ids: list[int]) -> StepResult:
        """Run the turn's tool calls, or score its answer."""
        self.turn += 1
        self.last_text = text = self.tok.decode(list(action_ids))
        calls = parse_tool_calls(text)
        if not calls:
            _, correct = self.score(text)
            return StepResult([], 1.0 if correct else 0.0, True, {"tool_calls": self.calls})
        self.calls += len(calls)
        done = self.turn >= self.max_turns
        obs = "".join(format_tool_response(run_tool(c, self.tools)) for c in calls)
        return StepResult(encode_observation(self.tok, obs), 0.0, done, {"tool_calls": self.calls})


class ToolWorkflow(EpisodeWorkflow):
    """``n`` ``ToolTask`` episodes per prompt."""

    def make_env(self, prompt: str, answer: str) -> ToolTask:
        """A ``ToolTask`` scored against ``answer``."""
        c = self.ctx
        return ToolTask(c.tokenizer, prompt, lambda t: c.score(t, answer), c.env.max_turns)


WORKFLOWS.add("tools", ToolWorkflow)
