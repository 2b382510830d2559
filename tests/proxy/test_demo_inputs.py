"""``megarl proxy demo-inputs`` and the docs/proxy.md walk-through it feeds: the walk-through's
commands run as written and print what the page shows."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.proxy.demo_inputs import main

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "proxy.md"
WORK_DIR = "runs/proxy-demo"  # where the walk-through runs, relative to the repository root


def _walkthrough() -> tuple[list[str], str, dict]:
    """(the commands of the inputs block, the prune command, the summary JSON the page shows)."""
    text = DOC.read_text()
    text = text[text.index("mkdir -p runs/proxy-demo") - len("```bash\n") :]  # the walk-through onwards
    inputs = re.search(r"```bash\n(mkdir -p runs/proxy-demo[^`]*?)```", text)
    assert inputs, "docs/proxy.md: the walk-through's inputs block is missing"
    prune = re.search(
        r"```text\n\$ (megarl proxy prune --model tiny-moe [^\n]*)\n(proxy written[^\n]*)\n(.*?)\nreport:",
        text,
        re.S,
    )
    assert prune, "docs/proxy.md: the walk-through's prune output is missing"
    return inputs.group(1).strip().splitlines(), prune.group(1), json.loads(prune.group(3))


def _megarl(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(cmd)
    assert argv[0] == "megarl", cmd
    return subprocess.run(
        [sys.executable, "-m", "megarl.cli", *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_existing_outputs_are_refused(tmp_path: Path, capsys):
    (tmp_path / "tiny-moe").mkdir()
    assert main([str(tmp_path)]) == 2
    assert f"{tmp_path / 'tiny-moe'} exists" in capsys.readouterr().err
    assert not (tmp_path / "calib.jsonl").exists()


def test_the_walkthrough_names_the_recipe_by_a_path_that_exists_from_its_work_dir():
    text = DOC.read_text()
    recipe = re.search(r"megarl proxy compare --config (\S+)", text).group(1)
    assert (ROOT / WORK_DIR / recipe).resolve() == ROOT / "tests" / "faults" / "recipe.yaml"


@pytest.mark.slow
def test_walkthrough_inputs_and_prune_run_as_written(tmp_path: Path):
    block, prune_cmd, shown = _walkthrough()
    assert block[0] == f"mkdir -p {WORK_DIR} && cd {WORK_DIR}"
    work = tmp_path / "proxy-demo"
    work.mkdir()
    for cmd in block[1:]:
        r = _megarl(cmd, work)
        assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in work.iterdir()) == ["calib.jsonl", "tiny-moe"]
    rows = [json.loads(line) for line in (work / "calib.jsonl").read_text().splitlines()]
    assert len(rows) == 200 and all(re.fullmatch(r"R \d{3}=\d{3}", r["text"]) for r in rows)

    r = _megarl(prune_cmd, work)
    assert r.returncode == 0, r.stderr
    printed = r.stdout[r.stdout.index("{") : r.stdout.index("\nreport:")]
    assert json.loads(printed) == shown  # the page shows this very run's summary
    report = json.loads((work / "tiny-moe-e4" / "proxy_report.json").read_text())
    assert report["num_experts"] == {"original": 8, "proxy": 4}
