"""megarl's CLI silences the known-harmless third-party warnings by message and module, and only those:
an unknown warning, or a known message from another module, still shows. The slow case runs a short
`megarl train` (and its resume) and reads its stderr."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megarl.quiet_warnings import KNOWN

REPO = Path(__file__).resolve().parents[2]

# every known warning, emitted as its module emits it (warn_explicit names the module), then an unknown
# one and a known message attributed to megarl's own code
EMIT = """
import warnings
from megarl.quiet_warnings import apply
assert apply()
cases = [
    (UserWarning, "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
     "megatron.core.optimizer"),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends"),
    (UserWarning, "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
     "megatron.core.transformer.transformer_config"),
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
     "`torch.distributed.all_gather_single` instead.", "torch.distributed.c10d_logger"),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor.",
     "megarl.learner.cpu_shims"),
    (UserWarning, "something nobody has seen before", "megatron.core.optimizer"),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm", "megarl.trainer.loop"),
]
for i, (cat, msg, mod) in enumerate(cases):
    warnings.warn_explicit(msg, cat, mod.replace(".", "/") + ".py", 10 + i, module=mod)
"""


def test_known_warnings_are_silenced_and_unknown_ones_show():
    r = subprocess.run([sys.executable, "-c", EMIT], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    shown = [line for line in r.stderr.splitlines() if "Warning:" in line]
    assert len(shown) == 2, r.stderr
    assert "something nobody has seen before" in shown[0]
    assert "megarl/trainer/loop.py:16: UserWarning: Apex is not installed" in shown[1]


def test_python_warning_options_win():
    r = subprocess.run(
        [sys.executable, "-W", "default", "-c", EMIT.replace("assert apply()", "assert not apply()")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    assert sum("Warning:" in line for line in r.stderr.splitlines()) == 7, r.stderr


def _known_line(line: str) -> bool:
    return any(re.search(message.rstrip("$"), line) for _, message, _ in KNOWN)


@pytest.mark.slow
def test_a_short_run_and_its_resume_print_no_known_warning(tmp_path):
    d = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    d["data"].update(train=str(tmp_path / "train.jsonl"), eval=str(tmp_path / "eval.jsonl"))
    d["data"]["generate"].update(num_train=64, num_eval=8)
    d["warmup"]["sft_steps"] = 2
    d["schedule"].update(steps=2, prompts_per_step=4, eval_every=0, eval_samples=8, eval_k=2)
    d["logging"].update(run_dir=str(tmp_path / "run"), plot=False)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(d))
    for steps in (2, 3):  # a fresh run, then a resume from its checkpoint
        r = subprocess.run(
            [sys.executable, "-m", "megarl.cli", "train", str(cfg), f"schedule.steps={steps}"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"step    {steps}/{steps}" in r.stdout
        known = [line for line in r.stderr.splitlines() if _known_line(line)]
        assert not known, "\n".join(known)
        assert "Warning:" not in r.stderr, (
            r.stderr
        )  # nothing else either, megarl's own .grad warning included
