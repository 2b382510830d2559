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
RUNS_PATH = re.compile(r"(?<![\w/])runs/[^\s'\"]+")


def _produced_before(cmd: TrainCommand, quoted: list[QuotedCommand]) -> list[str]:
    """Paths that commands quoted earlier in the same doc write: run dirs and ``--out`` of train
    commands, and every ``runs/`` path a data-making command (a script, ``python -c``) names."""
    out = []
    for q in quoted:
        if q is cmd.quoted or (q.line == cmd.quoted.line and q.doc == cmd.quoted.doc):
            break
        if q.doc != cmd.quoted.doc:
            continue
        out += PRODUCES.findall(q.line)
        if " train " not in f" {q.line} ":
            out += [p.strip("'\",)") for p in RUNS_PATH.findall(q.line)]
    return out


def config_problem(cmd: TrainCommand, produced: list[str] = ()) -> str | None:
    """Why the command's config and overrides fail the check (None when they pass). A path that an
    earlier command of the same doc writes is not required to exist yet."""
    saved = list(sys.path)
    if "PYTHONPATH" in cmd.env:
        sys.path.insert(0, str(ROOT / cmd.env["PYTHONPATH"]))
    for override in cmd.overrides:
        value = override.partition("=")[2]
        # runs/ is ignored by git: a path there exists on a fresh clone only when a command wrote it,
        # however many runs this checkout has kept
        if (
            value.startswith("runs/")
            and "/" in value[5:]
            and not any(value.startswith(p.rstrip("/") + "/") for p in produced)
        ):
            return f"{override}: no earlier command of {cmd.quoted.doc} writes {value}"
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
    commands, quoted = train_commands(), quoted_commands()
    assert len(commands) >= 40, f"only {len(commands)} train commands found: the scan is broken"
    bad = []
    for cmd in commands:
        problem = config_problem(cmd, _produced_before(cmd, quoted))
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
    assert "runs/w/init_policy" in (config_problem(hf, ["runs/other"]) or "")
