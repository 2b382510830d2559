"""The docs hold together: every relative link and every repository path they name exists, every
``megarl <command>`` they quote is a real (sub)command, and no product file points outside the
repository or at the history of the work."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
PATH_PREFIXES = ("megarl/", "tests/", "docs/", "examples/", "slurm/", "benchmarks/", "reference/")
PRODUCT = ["megarl", "tests", "docs", "reference", "examples", "slurm", "benchmarks", ".ci"]
PRODUCT_FILES = ["README.md", "Makefile", "pyproject.toml"]

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
COMMAND = re.compile(
    r"(?:^|(?<=[\s/;&|(`]))(?:-m\s+megarl\.cli|megarl)[ \t]+([a-z][\w-]*)(?:[ \t]+([^\s\\]+))?", re.M
)
# built from pieces so that this file does not match itself
PRIVATE = re.compile(r"(?<![\w-])(?:\.\./)*" + "sha" + r"red/|/work/" + "sha" + "red")
HISTORY = re.compile(r"\b" + "iss" + r"ue\s+#?\d+", re.I)


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def _split_fenced(text: str) -> tuple[str, list[str]]:
    """(prose with fenced blocks blanked, the fenced blocks)."""
    blocks = FENCE.findall(text)
    return FENCE.sub("", text), blocks


def _bad_links(md: Path) -> list[str]:
    prose, _ = _split_fenced(md.read_text())
    bad = []
    for m in LINK.finditer(prose):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (md.parent / path).exists():
            bad.append(f"{_rel(md)}: link ({target}) -> no such file")
    return bad


def _named_path(span: str) -> str | None:
    """The repository path a backticked span names, or None when it names none."""
    span = span.strip()
    if not span.startswith(PATH_PREFIXES) or " " in span or re.search(r"[<>{}$]|NAME|\.\.\.|…", span):
        return None
    span = re.split(r"::|:(?=[\w*])", span, maxsplit=1)[0]  # file.py::test, file.py:function, file.py:12
    return span.rstrip(".,;)")


def _missing_paths(md: Path) -> list[str]:
    prose, _ = _split_fenced(md.read_text())
    bad = []
    for m in SPAN.finditer(prose):
        path = _named_path(m.group(1))
        if path is None:
            continue
        found = any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
        if not found:
            bad.append(f"{_rel(md)}: `{m.group(1)}` -> {path} does not exist")
    return bad


def _quoted_commands() -> dict[tuple[str, ...], str]:
    """Distinct ``megarl <command> [<subcommand>]`` prefixes quoted in code blocks -> where first seen."""
    found: dict[tuple[str, ...], str] = {}
    for md in DOCS:
        _, blocks = _split_fenced(md.read_text())
        for block in blocks:
            for m in COMMAND.finditer(block):
                sub, nxt = m.group(1), m.group(2)
                key = (
                    (sub, nxt)
                    if nxt and _takes_subcommand(sub) and re.fullmatch(r"[a-z][\w-]*", nxt)
                    else (sub,)
                )
                found.setdefault(key, _rel(md))
    return found


@functools.cache
def _help(args: tuple[str, ...]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megarl.cli", *args, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _takes_subcommand(sub: str) -> bool:
    """Whether ``megarl sub`` dispatches to subcommands (its help lists ``{a,b}`` or ``<command>``)."""
    out = _help((sub,)).stdout
    return bool(re.search(r"usage: megarl \S+ (?:\[-h\] )?(?:\{|<command>)", out))


@pytest.mark.parametrize("md", DOCS, ids=_rel)
def test_relative_links_resolve(md: Path):
    assert _bad_links(md) == []


@pytest.mark.parametrize("md", DOCS, ids=_rel)
def test_backticked_repository_paths_exist(md: Path):
    assert _missing_paths(md) == []


def test_quoted_megarl_commands_exist():
    commands = _quoted_commands()
    assert ("train",) in commands, "the docs quote no `megarl train` command: the scan is broken"
    bad = []
    for key, where in sorted(commands.items()):
        r = _help(key)
        if r.returncode != 0:
            bad.append(
                f"{where}: `megarl {' '.join(key)} --help` exit {r.returncode}: {r.stderr.strip()[-300:]}"
            )
    assert bad == []


def _product_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "--", *PRODUCT, *PRODUCT_FILES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    return [ROOT / f for f in out if f and (ROOT / f).is_file()]


def test_no_private_paths_or_work_history_in_product_files():
    bad = []
    for f in _product_files():
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue  # binary (images)
        for lineno, line in enumerate(text.splitlines(), 1):
            for pat, what in (
                (PRIVATE, "a path outside the repository"),
                (HISTORY, "the history of the work"),
            ):
                if pat.search(line):
                    bad.append(f"{_rel(f)}:{lineno}: {what}: {line.strip()[:120]}")
    assert bad == []


def test_the_checks_catch_what_they_look_for(tmp_path: Path):
    """The scanners are not vacuous: a broken link, a missing path and a private path are found."""
    md = tmp_path / "page.md"
    md.write_text("see [x](missing.md#a), [y](page.md) and [z](https://example.org)\n")
    assert _bad_links(md) == [f"{md}: link (missing.md#a) -> no such file"]
    assert _named_path("megarl/no_such_module.py:main") == "megarl/no_such_module.py"
    assert _named_path("tests/x.py::test_y") == "tests/x.py"
    assert _named_path("examples/methods/NAME.yaml") is None
    assert PRIVATE.search("../" + "sha" + "red/specs/a.md") and HISTORY.search("see iss" + "ue 6")
    assert [
        m.group(1) for m in COMMAND.finditer(".venv/bin/megarl proxy prune x\npython -m megarl.cli train")
    ] == [
        "proxy",
        "train",
    ]
