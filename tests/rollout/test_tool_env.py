"""The tool-use environment: the tool-call protocol, the contained calculator (hostile calls refused
or stopped, never executed), and token-exact episodes through the episode runner."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from megarl.data.tokenizer import CharTokenizer
from megarl.rollout.calculator import evaluate, run_contained
from megarl.rollout.environments import run_episode
from megarl.rollout.tool_calls import format_tool_call, parse_tool_calls
from megarl.rollout.tool_env import ToolTask
from megarl.rollout.types import GenerateResult, Sample, SamplingParams

ALPHABET = "".join(sorted(set("0123456789+-*/()=.:,?{}[]'\"_<>/ abcdefghijklmnopqrstuvwxyz")))


def test_tool_calls_are_parsed_and_malformed_ones_named():
    text = "x" + format_tool_call("calculator", {"expression": "1+2"}) + "y"
    (c,) = parse_tool_calls(text)
    assert (c.name, c.arguments, c.error) == ("calculator", {"expression": "1+2"}, None)
    bad = parse_tool_calls('<tool_call>{"name": "calculator", </tool_call><tool_call>[1]</tool_call>')
    assert "invalid JSON" in bad[0].error and "expected" in bad[1].error
    assert "no </tool_call>" in parse_tool_calls('<tool_call>{"name": "c"}')[0].error
    args = parse_tool_calls('<tool_call>{"name": "c", "arguments": 3}</tool_call>')[0]
    assert args.name == "c" and "arguments must be an object" in args.error
    assert parse_tool_calls("no call here") == []


@pytest.mark.parametrize(
    "expr, want",
    [
        ("2+3*4", "14"),
        ("(1+2)/4", "0.75"),
        ("-2**3", "-8"),
        ("7//2 + 7%2", "4"),
        ("1/0", "error: division by zero"),
        ("2**2**40", "error: exponent"),
        ("a+1", "error: Name is not allowed"),
        ("(1).real", "error: Attribute is not allowed"),
        ("'ab'*3", "error: Constant is not allowed"),
        ("lambda: 1", "error: Lambda is not allowed"),
        ("1+", "error: not an expression"),
        ("9" * 300, "error: expression longer than"),
    ],
)
def test_calculator_evaluates_arithmetic_and_refuses_the_rest(expr, want):
    assert evaluate(expr).startswith(want)


def test_hostile_calls_do_not_escape_the_worker(tmp_path: Path):
    marker = tmp_path / "pwned"
    hostile = [
        f"__import__('os').system('touch {marker}')",
        f"open('{marker}', 'w')",
        "[x for x in ().__class__.__base__.__subclasses__()]",
    ]
    for expr in hostile:
        assert run_contained(expr).startswith("error:"), expr
    assert not marker.exists()
    # a legal expression whose value explodes: stopped by the worker's limits, the caller gets an error
    deep = "(" * 8 + "2**64" + ")**64" * 8
    out = run_contained(deep, timeout_s=5.0)
    assert out.startswith("error:"), out[:80]


class ScriptedEngine:
    """Answers each turn with the next text of a list; logprobs -0.5 per token."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.max_model_len = tok, list(texts), None
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids, n=1, sampling=None, **_):
        self.prompts.append(list(prompt_ids))
        ids = self.tok.encode(self.texts.pop(0), bos=False)
        return GenerateResult(list(prompt_ids), [Sample(ids, [-0.5] * len(ids), "stop")])


def _episode(texts, max_turns=3, answer="14"):
    tok = CharTokenizer(ALPHABET)
    env = ToolTask(
        tok, "what is 2+3*4? ", lambda t: (float(t.strip() == answer), t.strip() == answer), max_turns
    )
    engine = ScriptedEngine(tok, texts)
    ep = asyncio.run(run_episode(engine, env, SamplingParams(max_new_tokens=200), max_turns=max_turns))
    return tok, env, engine, ep


def test_a_tool_episode_is_token_exact_and_masks_observations():
    call = format_tool_call("calculator", {"expression": "2+3*4"})
    tok, env, engine, ep = _episode([call, "14"])
    obs = tok.encode("<tool_response>14</tool_response>", bos=False)
    prompt = tok.encode("what is 2+3*4? ")
    call_ids, answer_ids = tok.encode(call, bos=False), tok.encode("14", bos=False)
    assert ep.tokens == prompt + call_ids + obs + answer_ids  # no re-tokenisation between turns
    assert engine.prompts[1] == prompt + call_ids + obs  # turn 2 saw exactly the sampled ids + observation
    assert ep.loss_mask == [0.0] * len(prompt) + [1.0] * len(call_ids) + [0.0] * len(obs) + [1.0] * 2
    assert ep.rewards == [0.0, 1.0] and env.calls == 1 and env.last_text == "14"
    assert [s[2] for s in ep.turn_spans] == ["prompt", "assistant", "observation", "assistant"]


def test_malformed_calls_and_unknown_tools_get_an_observation_not_a_crash():
    tok, env, _, ep = _episode(
        [
            '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
            '<tool_call>{"name": "shell", "arguments": {}}</tool_call>',
            "<tool_call>{oops</tool_call>",
        ]
    )
    text = tok.decode(ep.tokens)  # ';' of "unknown tool 'shell'; tools: ..." is not in the alphabet: dropped
    assert "needs the argument 'expression'" in text and "unknown tool 'shell' tools: calculator" in text
    assert "malformed tool call: invalid" in text  # upper-case letters are not in this alphabet
    assert ep.rewards == [0.0, 0.0, 0.0] and env.turn == 3  # max_turns reached without an answer


def test_the_workflow_is_registered_for_the_config():
    from megarl.catalogue import load_builtin
    from megarl.rollout.workflow import WORKFLOWS

    load_builtin()
    assert "tools" in WORKFLOWS.names()
