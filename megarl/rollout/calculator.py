"""A calculator tool: arithmetic expressions, evaluated without running any code of the model's.

The expression is parsed with ``ast`` and only numbers, ``+ - * / // % **``, unary signs and
parentheses are evaluated; names, calls, attributes, subscripts and every other node are refused
by name, so a hostile call has nothing to execute. The evaluation still runs in a worker process
with a CPU-time limit, an address-space cap, no inherited environment and a private temporary
working directory, and is killed at ``timeout_s`` (``2 ** 2 ** 40`` stays a cost bounded by the
exponent check, a deep expression by the limits).
"""

from __future__ import annotations

import ast
import json
import operator
import os
import subprocess
import sys
import tempfile

MAX_EXPRESSION = 200  # characters
MAX_EXPONENT = 64
MEMORY_BYTES = 256 * 2**20

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> str:
    """The value of an arithmetic ``expression`` as text, or ``error: ...`` naming what was refused."""
    if len(expression) > MAX_EXPRESSION:
        return f"error: expression longer than {MAX_EXPRESSION} characters"
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        return f"error: not an expression ({e.msg})"
    try:
        value = _eval(tree.body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (ValueError, OverflowError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    try:
        return str(value)
    except ValueError:  # an int too long to print (Python's digit limit)
        return "error: the result is too large to print"


def _eval(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")


def _limit_this_process() -> None:
    """The worker's own limits, set before it reads the expression (no preexec_fn: the trainer is
    multi-threaded, where forking hooks can deadlock)."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (2, 2))


def run_contained(expression: str, timeout_s: float = 2.0) -> str:
    """``evaluate(expression)`` in a limited worker process (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="megarl-tool-") as tmp:
        try:
            p = subprocess.run(
                [sys.executable, "-I", "-m", "megarl.rollout.calculator"],
                input=json.dumps(expression),
                capture_output=True,
                text=True,
                timeout=timeout_s,
                cwd=tmp,
                env={"PATH": os.defpath},  # -I: no PYTHONPATH, no user site; megarl comes from the install
                check=False,
            )
        except subprocess.TimeoutExpired:
            return f"error: the tool ran past {timeout_s} s"
    if p.returncode != 0:
        return f"error: the tool's process failed (exit {p.returncode})"
    return p.stdout.strip()


if __name__ == "__main__":
    _limit_this_process()
    print(evaluate(str(json.loads(sys.stdin.read()))))
