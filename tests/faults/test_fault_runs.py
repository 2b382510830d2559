"""End to end on a tiny Qwen3-MoE (8 experts, top-2, 2 layers, char tokenizer) and its proxy made by
``megarl proxy prune`` (4 experts): ``megarl proxy compare`` trains both for 4 steps with an fp16
loss-scale overflow injected at step 2, a NaN at step 3 and bfloat16 attention at step 4; then
dumped steps are replayed.

- both runs report the same event type at the same steps (non-finite at 2 and 3, logprob gap
  at 4); the optimizer skips steps 2 and 3 and the weights stay finite (step 4 trains normally);
- the fidelity report (markdown, PNG, JSON) is written;
- a dumped clean step replayed on the same model gives the recorded loss and grad norm bit for
  bit, for both of its optimizer steps (2 mini-batches; the dump holds the full learner state);
  the NaN step replayed on the proxy shows the same detector; a model of another shape is
  refused before any work.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.tiny_moe import make_moe_dir

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "tests" / "faults" / "recipe.yaml"
pytestmark = pytest.mark.slow

INJECT = (
    "faults.inject=[{kind: nan, target: decoder.layers.0.mlp, step: 3}, "
    "{kind: fp16, target: decoder.layers.1.mlp, step: 2, loss_scale: 1.0e+9}, "
    "{kind: bf16, target: decoder.layers.0.self_attention, step: 4}]"
)
CALIB = [f"R {a}{b}{c}={c}{b}{a}" for a in "1357" for b in "02468" for c in "159"]


def events(run_dir: Path) -> dict[int, list[dict]]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r
    return out


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    from megarl.data.tasks import generate_task_files
    from megarl.proxy.compare import run_compare
    from megarl.proxy.prune import prune_moe_checkpoint

    tmp = tmp_path_factory.mktemp("faults")
    # written before the two runs start at once (each would generate them otherwise)
    generate_task_files(
        train_path=str(tmp / "train.jsonl"),
        eval_path=str(tmp / "eval.jsonl"),
        task="reverse",
        digits=3,
        num_train=200,
        num_eval=8,
        seed=0,
    )
    orig = make_moe_dir(tmp / "orig")
    prune_moe_checkpoint(str(orig), str(tmp / "proxy"), 4, CALIB)
    old = os.environ.get("MEGARL_NUM_THREADS")
    os.environ["MEGARL_NUM_THREADS"] = "1"
    try:
        rep = run_compare(
            str(RECIPE),
            str(orig),
            str(tmp / "proxy"),
            4,
            str(tmp / "cmp"),
            [
                f"data.train={tmp / 'train.jsonl'}",
                f"data.eval={tmp / 'eval.jsonl'}",
                INJECT,
                "faults.dump_on=[nonfinite]",
                "faults.dump_steps=[1, 4]",
                "faults.detectors.logprob_gap_max=1.0e-4",
                "schedule.mini_batches=2",
            ],
            parallel=True,
        )
    finally:
        if old is None:
            os.environ.pop("MEGARL_NUM_THREADS")
        else:
            os.environ["MEGARL_NUM_THREADS"] = old
    return tmp, rep


def test_injected_faults_are_detected_at_the_same_step_on_original_and_proxy(compared):
    tmp, rep = compared
    for name in ("original", "proxy"):
        m = events(tmp / "cmp" / name)
        assert [e["type"] for e in m[2]["events"]] == ["nonfinite"], (name, m[2].get("events"))
        # the fp16 overflow is in the backward: finite loss, non-finite gradient
        assert set(m[2]["events"][0]["detail"]) == {"grad_norm", "optimizer_step_skipped"}
        assert [e["type"] for e in m[3]["events"]] == ["nonfinite"]
        assert m[3]["events"][0]["detail"]["loss"] == "nan"  # the NaN is in the forward
        for s in (2, 3):
            assert (
                m[s]["train/update_successful"] == 0.0
                and m[s]["events"][0]["detail"]["optimizer_step_skipped"]
            )
        assert "events" not in m[1]
        # the skipped steps left the weights finite: step 4 trains normally
        assert m[4]["train/update_successful"] == 1.0 and m[4]["train/loss"] is not None
        # bf16 attention in the train forward of step 4: the train/rollout logprob gap jumps
        # (~1e-7 -> ~5e-4 measured), the same precision symptom on both models
        assert [e["type"] for e in m[4]["events"]] == ["logprob_gap"], m[4].get("events")
        assert m[1]["faults/logprob_gap_first"] < 1e-5 and m[4]["faults/logprob_gap_first"] > 1e-4
        assert m[4]["faults/nonfinite_total"] == 2
        assert len(m[4]["router/layer0/load"]) == (8 if name == "original" else 4)
    assert rep["events"]["same_types_per_step"]
    assert rep["events"]["original"] == [(2, "nonfinite"), (3, "nonfinite"), (4, "logprob_gap")]
    out = tmp / "cmp"
    assert (out / "fidelity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "fidelity.md").read_text()
    assert "| entropy (nats/token) |" in md and "Same event types at the same steps: **yes**" in md
    assert {c["key"] for c in rep["curves"]} >= {
        "train/loss",
        "reward/mean",
        "train/entropy",
        "router/imbalance",
    }
    assert rep["runs"]["proxy"]["params_ratio"] < 1.0


def test_replay_reproduces_the_recorded_step_exactly_and_the_fault_on_the_proxy(compared):
    tmp, _ = compared
    dumps = tmp / "cmp" / "original" / "dumps"
    assert sorted(p.name for p in dumps.iterdir()) == [
        "step_000001",
        "step_000002",
        "step_000003",
        "step_000004",
    ]
    script = (
        "import json, sys\n"
        "from megarl.proxy.replay import replay_dump\n"
        "out = [replay_dump(d, m or None) for d, m in json.loads(sys.argv[1])]\n"
        "print('REPORT' + json.dumps(out, default=str))\n"
    )
    jobs = [
        (str(dumps / "step_000001"), ""),
        (str(dumps / "step_000002"), ""),
        (str(dumps / "step_000003"), str(tmp / "proxy")),
        (str(dumps / "step_000001"), str(tmp / "proxy")),
        (str(dumps / "step_000004"), ""),
    ]
    p = subprocess.run(
        [sys.executable, "-c", script, json.dumps(jobs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    clean, overflow, on_proxy, clean_on_proxy, later = json.loads(p.stdout.split("REPORT", 1)[1])
    # step 1: Adam is fresh in the run as in the replay; step 4: the dump holds the full learner
    # state (Adam moments of step 1); both optimizer steps (2 mini-batches) replay exactly
    assert any("full learner state" in n for n in later["notes"])
    assert not any("full learner state" in n for n in clean["notes"])
    for rep, step in ((clean, 1), (later, 4)):
        meta = json.loads((dumps / f"step_{step:06d}" / "dump.json").read_text())
        assert len(rep["optimizer_steps"]) == 2
        for row, rec in zip(rep["optimizer_steps"], meta["optimizer_steps"]):
            assert row["exact"] and row["replayed"]["grad_norm"] == rec["grad_norm"], (step, row, rec)
            assert row["replayed"]["loss"] == rec["loss"]
    assert [e["type"] for e in later["events"]] == ["logprob_gap"] and later["injections"] == ["bf16"]
    assert clean["events"] == [] and clean["same_event_types"]
    assert overflow["injections"] == ["fp16"] and [e["type"] for e in overflow["events"]] == ["nonfinite"]
    assert overflow["optimizer_steps"][0]["exact"]  # the same NaN grad norm, the same finite loss
    assert on_proxy["notes"] and "4 routed experts" in on_proxy["notes"][0]
    assert [e["type"] for e in on_proxy["events"]] == ["nonfinite"] and on_proxy["same_event_types"]
    # a clean step on the proxy (old logprobs recomputed by the proxy): finite, no event
    assert any("recomputed" in n for n in clean_on_proxy["notes"])
    assert (
        clean_on_proxy["events"] == [] and clean_on_proxy["optimizer_steps"][0]["replayed"]["grad_norm"] > 0
    )


def test_replay_on_an_incompatible_model_is_refused_before_any_work(compared, tmp_path, capsys):
    from megarl.proxy.replay import main

    tmp, _ = compared
    dump = tmp / "cmp" / "original" / "dumps" / "step_000001"
    cfg = json.loads((tmp / "orig" / "config.json").read_text())
    for key, value, msg in (
        ("hidden_size", 32, "hidden_size: dump 64, model 32"),
        ("num_hidden_layers", 3, "num_hidden_layers: dump 2, model 3"),
        ("vocab_size", 32, "vocab_size: dump 24, model 32"),
    ):
        bad = tmp_path / key
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        assert main([str(dump), "--model", str(bad)]) == 2
        err = capsys.readouterr().err
        assert msg in err and f"model {bad} does not fit the dump" in err, err
    assert main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
