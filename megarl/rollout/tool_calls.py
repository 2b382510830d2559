"""The tool-call protocol of Hermes/Qwen-style chat templates, as vLLM and SGLang parse it.

A model calls a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (JSON
between the tags, whitespace allowed); the result goes back as ``<tool_response>...</tool_response>``.
Parsing never raises: a malformed call becomes a ``ToolCall`` with ``error`` set, whose observation
names what was wrong, so the episode goes on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)(" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)


@dataclass
class ToolCall:
    """One call: ``name`` and ``arguments``, or ``error`` (why it could not be read)."""

    name: str = ""
    arguments: dict = field(default_factory=dict)
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>`` block of ``text`` in order (an unclosed last block included)."""
    calls = []
    for m in _CALL.finditer(text):
        body, closed = m.group(1).strip(), bool(m.group(2))
        if not closed:
            calls.append(ToolCall(error=f"malformed tool call: no {CALL_CLOSE}"))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(error=f"malformed tool call: invalid JSON ({e.msg} at column {e.colno})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(error='malformed tool call: expected {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            calls.append(ToolCall(name=obj["name"], error="malformed tool call: arguments must be an object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


def format_tool_call(name: str, arguments: dict) -> str:
    """The text of a call as a model should write it."""
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"


def format_tool_response(content: str) -> str:
    """The observation text of one tool result (or error)."""
    return f"{RESPONSE_OPEN}{content}{RESPONSE_CLOSE}"
