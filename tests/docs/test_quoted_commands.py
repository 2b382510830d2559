"""Every command README.md and docs/ quote is accounted for: each ``megarl train`` command's config
and overrides pass the config check as written, and docs/commands.md lists every quoted command
with how it is checked or how long it took."""

from __future__ import annotations

import re
import sys

import pytest

from megarl.trainer.config import ConfigError
from megarl.trainer.config_checks import check_layout, layout_hf_config
from megarl.trainer.config_loading import load_config
from tests.docs.quoted_commands import ROOT, QuotedCommand, TrainCommand, quoted_commands, train_commands

INDEX = ROOT / "docs" / "commands.md"
PRODUCES = re.compile(r"(?:logging\.run_dir=|--out\s+)(\S+)")
UNREADABLE = re.compile(r"cannot read (\S+?):")


def _produced_before(cmd: TrainCommand, commands: list[TrainCommand]) -> list[str]:
    """Directories that earlier commands quoted in the same doc write (their run dirs)."""
    out = []
    for c in commands:
        if c is cmd:
            break
        if c.quoted.doc == cmd.quoted.doc:
            out += PRODUCES.findall(c.quoted.line)
    return out


def config_problem(cmd: TrainCommand, produced: list[str] = ()) -> str | None:
    """Why the command's config and overrides fail the check (None when they pass). A path that an
    earlier command of the same doc writes is not required to exist yet."""
    saved = list(sys.path)
    if "PYTHONPATH" in cmd.env:
        sys.path.insert(0, str(ROOT / cmd.env["PYTHONPATH"]))
    try:
        cfg = load_config(ROOT / cmd.quoted.cwd / cmd.config, cmd.overrides)
        check_layout(cfg, layout_hf_config(cfg), cmd.nproc or cfg.parallel.world_size or None)
    except ConfigError as e:
        missing = UNREADABLE.search(str(e))
        if missing and any(missing.group(1).startswith(p.rstrip("/") + "/") for p in produced):
            return None
        return str(e)
    finally:
        sys.path[:] = saved
    return None


def _index_key(line: str) -> str:
    """How a quoted command is found in docs/commands.md: its first line, spaces collapsed."""
    return " ".join(line.split("\n")[0].split())


def test_every_quoted_train_command_passes_the_config_check(monkeypatch):
    monkeypatch.chdir(ROOT)  # overrides name paths relative to the repository root, as a reader types them
    commands = train_commands()
    assert len(commands) >= 40, f"only {len(commands)} train commands found: the scan is broken"
    bad = []
    for cmd in commands:
        problem = config_problem(cmd, _produced_before(cmd, commands))
        if problem:
            bad.append(f"{cmd.quoted.doc}: `{cmd.quoted.line[:120]}`: {problem}")
    assert bad == []


def test_docs_commands_lists_every_quoted_command():
    index = " ".join(INDEX.read_text().split())
    missing = sorted(
        {f"{q.doc}: {_index_key(q.line)}" for q in quoted_commands() if _index_key(q.line) not in index}
    )
    assert missing == [], "add these to docs/commands.md with how they are checked:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "override, expected",
    [("schedule.stepz=3", "unknown key schedule.stepz"), ("parallel.tp=3", "parallel.tp=3")],
)
def test_the_config_check_catches_a_bad_quoted_command(monkeypatch, override, expected):
    monkeypatch.chdir(ROOT)
    q = QuotedCommand("docs/x.md", f"megarl train examples/quickstart.yaml {override}")
    problem = config_problem(TrainCommand(q, config="examples/quickstart.yaml", overrides=[override]))
    assert problem is not None and expected in problem
    # a path only an earlier command of the same doc writes is accepted, any other is not
    hf = TrainCommand(q, config="examples/quickstart.yaml", overrides=["model.hf_dir=runs/w/init_policy"])
    assert config_problem(hf, ["runs/w"]) is None
    assert "cannot read" in (config_problem(hf, ["runs/other"]) or "")
