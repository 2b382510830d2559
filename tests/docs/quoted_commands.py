"""The shell commands README.md and docs/ quote, as a reader would type them.

A quoted command is one logical line of a ```bash block: continuation lines joined, the trailing
``# comment`` dropped. ``train_commands`` picks the ``megarl train`` invocations (however spelled:
``megarl``, ``python -m megarl.cli``, ``torchrun ... -m megarl.cli``, ``.venv/bin/megarl``) and
splits them into environment, config, overrides and process count.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
BASH_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.S | re.M)
ENV_ASSIGN = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")
# a placeholder a reader replaces (CONFIG.yaml, key=value ..., HF_DIR) marks a synopsis, not a command
PLACEHOLDER = re.compile(
    r"\b(?:CONFIG\.yaml|key=value|HF_DIR|CKPT_DIR|RUN_DIR|PROXY_DIR|RECIPE)\b|\.\.\.|\[-"
)


@dataclass
class QuotedCommand:
    """One quoted command line and where it is quoted."""

    doc: str
    line: str
    cwd: str = ""  # a preceding ``cd DIR`` in the same block

    def words(self) -> list[str]:
        return shlex.split(self.line)


@dataclass
class TrainCommand:
    """A quoted ``megarl train`` invocation, split."""

    quoted: QuotedCommand
    env: dict[str, str] = field(default_factory=dict)
    nproc: int | None = None
    config: str = ""
    overrides: list[str] = field(default_factory=list)
    check_only: bool = False


def _open_quote(line: str) -> bool:
    try:
        shlex.split(line, comments=True)
    except ValueError:
        return True
    return False


def _logical_lines(block: str) -> list[str]:
    """Lines with backslash continuations joined and a quoted string spanning lines kept whole."""
    lines, cur = [], ""
    for raw in block.splitlines():
        cur += raw.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        if _open_quote(cur):
            cur += "\n"
            continue
        if cur.strip():
            lines.append(cur.strip())
        cur = ""
    return lines


def _strip_comment(line: str) -> str:
    """Drop a trailing ``# comment`` that is outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


def quoted_commands() -> list[QuotedCommand]:
    """Every logical command line of every ```bash block in README.md and docs/."""
    out = []
    for md in DOCS:
        rel = str(md.relative_to(ROOT))
        for block in BASH_BLOCK.findall(md.read_text()):
            cwd = ""
            for line in _logical_lines(block):
                line = _strip_comment(line)
                if not line:
                    continue
                if line.startswith("cd ") and "&&" not in line:
                    cwd = line[3:].strip()
                    continue
                out.append(QuotedCommand(rel, line, cwd))
    return out


def _train_start(words: list[str]) -> int | None:
    """Index of the word after ``train`` when ``words`` runs ``megarl train``; None otherwise."""
    for i, w in enumerate(words[:-1]):
        if words[i + 1] != "train":
            continue
        if w.endswith("megarl") or (w == "megarl.cli" and i > 0 and words[i - 1] == "-m"):
            return i + 2
    return None


def train_commands() -> list[TrainCommand]:
    """The quoted ``megarl train`` invocations with a concrete config (synopsis lines skipped)."""
    out = []
    for q in quoted_commands():
        if PLACEHOLDER.search(q.line):
            continue
        try:
            words = q.words()
        except ValueError:  # a multi-line python -c snippet: not a train command
            continue
        start = _train_start(words)
        if start is None:
            continue
        cmd = TrainCommand(q)
        for w in words[:start]:
            if ENV_ASSIGN.fullmatch(w) and not cmd.config:
                key, _, value = w.partition("=")
                cmd.env[key] = value
        if "--nproc-per-node" in words[:start]:
            cmd.nproc = int(words[words.index("--nproc-per-node") + 1])
        rest = words[start:]
        cmd.check_only = "--check" in rest
        rest = [w for w in rest if w != "--check"]
        cmd.config, cmd.overrides = rest[0], rest[1:]
        out.append(cmd)
    return out
