"""Replay keeps every injected fault kind on a proxy.

One 11-step run of tests/faults/recipe.yaml on the tiny Qwen3-MoE (8 experts, top-2) injects one
fault kind per step from step 4 on (token poison, advantage poison, NaN output, Inf gradient, fp16
loss-scale overflow, bfloat16 attention, scaled logits, NaN weights of routed expert 6) and dumps
every one of those steps. Each
dump is replayed with the default options on a proxy made from the dump's own pre-step weights
(4 of the 8 experts kept bit-exactly, the documented route); the replay must fire the recorded
event types, and its list of re-applied injections must be what it really applied.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.tiny_moe import make_moe_dir, slice_experts

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "tests" / "faults" / "recipe.yaml"
pytestmark = pytest.mark.slow

KINDS = {
    4: ("poison", "{kind: poison, field: tokens, fraction: 0.3, step: 4}"),
    5: ("poison", "{kind: poison, field: advantages, scale: 1000.0, step: 5}"),
    6: ("nan", "{kind: nan, target: decoder.layers.0.mlp, step: 6}"),
    7: (
        "inf",
        "{kind: inf, where: grad, target: decoder.layers.1.self_attention.linear_proj.weight, step: 7}",
    ),
    8: ("fp16", "{kind: fp16, target: decoder.layers.1.mlp, step: 8, loss_scale: 1.0e+9}"),
    9: ("bf16", "{kind: bf16, target: decoder.layers.0.self_attention, step: 9}"),
    10: ("logits", "{kind: logits, scale: 3.0, step: 10}"),
    # routed expert 6 (of 8) by its global id: the proxy keeps it as expert 3 (its prune report says)
    11: (
        "nan",
        "{kind: nan, where: weight, target: decoder.layers.0.mlp, expert: 6, fraction: 0.01, step: 11}",
    ),
}
KEPT = [0, 2, 4, 6]

SCRIPT = (
    "import json, sys\n"
    "from megarl.proxy.replay import replay_dump\n"
    "from megarl.faults.dump import DumpError\n"
    "out = []\n"
    "for d, m, i in json.loads(sys.argv[1]):\n"
    "    try:\n"
    "        out.append(replay_dump(d, m or None, inject=i))\n"
    "    except DumpError as e:\n"
    "        out.append({'error': str(e)})\n"
    "print('REPORT' + json.dumps(out, default=str))\n"
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megarl.data.tasks import generate_task_files

    tmp = tmp_path_factory.mktemp("kinds")
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
    inject = "faults.inject=[" + ", ".join(v for _, v in KINDS.values()) + "]"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "megarl.cli",
            "train",
            str(RECIPE),
            f"model.hf_dir={orig}",
            f"logging.run_dir={tmp / 'run'}",
            f"schedule.steps={max(KINDS)}",
            f"data.train={tmp / 'train.jsonl'}",
            f"data.eval={tmp / 'eval.jsonl'}",
            inject,
            f"faults.dump_steps=[{', '.join(str(s) for s in KINDS)}]",
            "faults.dump_learner_state=false",
            "faults.detectors.logprob_gap_max=1.0e-4",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT), MEGARL_NUM_THREADS="1"),
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return tmp


def replay(jobs: list) -> list[dict]:
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(jobs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(p.stdout.split("REPORT", 1)[1])


def types(events: list[dict]) -> list[str]:
    return sorted({e["type"] for e in events})


@pytest.fixture(scope="module")
def reports(run):
    """Every replay of the tests in one process (start-up dominates a replay of this model)."""
    import shutil

    import torch

    dumps = run / "run" / "dumps"
    jobs = []
    for step in KINDS:
        d = dumps / f"step_{step:06d}"
        proxy = slice_experts(d / "weights", run / f"proxy_{step}", KEPT)
        layer0 = {"layer": 0, "kept": KEPT, "clusters": [[e, e + 1] for e in KEPT]}
        layer0["new_index"] = {str(e): j for j, e in enumerate(KEPT)}
        (proxy / "proxy_report.json").write_text(json.dumps({"layers": [layer0]}))
        jobs.append((str(d), str(proxy), True))
    tok = dumps / "step_000004"
    jobs += [(str(tok), "", True), (str(tok), "", False)]
    # the same dump without its clean batch (as a dump that does not carry one)
    bare = run / "bare" / "step_000004"
    shutil.copytree(tok, bare)
    raw = torch.load(bare / "batches.pt", weights_only=True)
    for r in raw:
        r.pop("clean_batch", None)
        r.pop("clean_dp_shares", None)
    torch.save(raw, bare / "batches.pt")
    jobs += [(str(bare), str(run / "proxy_4"), True), (str(bare), str(run / "proxy_4"), False)]
    # a NaN in routed expert 6 of layer 0: the 4-expert proxy has no such expert
    expert = run / "expert" / "step_000006"
    shutil.copytree(dumps / "step_000006", expert)
    meta = json.loads((expert / "dump.json").read_text())
    meta["injections"][0]["target"] = "decoder.layers.0.mlp.experts.local_experts.6"
    (expert / "dump.json").write_text(json.dumps(meta))
    jobs += [(str(expert), "", True), (str(expert), str(run / "proxy_6"), True)]
    # a proxy of the run's starting weights, not of the dump's
    step0 = slice_experts(run / "orig", run / "proxy_0", [0, 2, 4, 6])
    jobs.append((str(dumps / "step_000009"), str(step0), True))
    reps = replay(jobs)
    n = len(KINDS)
    return {
        "kinds": reps[:n],
        "original": reps[n : n + 2],
        "bare": reps[n + 2 : n + 4],
        "expert": reps[n + 4 : n + 6],
        "step0": reps[n + 6],
    }


def test_every_injected_kind_replays_with_its_recorded_event_on_a_proxy(reports):
    reps = reports["kinds"]
    for (step, (kind, _)), rep in zip(KINDS.items(), reps):
        recorded = types(rep["recorded_events"])
        assert recorded, (step, "the run recorded no event for", kind)
        assert types(rep["events"]) == recorded, (step, kind, rep["events"], rep["notes"])
        assert rep["same_event_types"]
        assert rep["injections"] == [kind], (step, rep["injections"])
        assert rep["injections_in_batch"] == [], (step, rep)
        assert not any("pre-step backbone" in n for n in rep["notes"]), rep["notes"]
    # the fault in original expert 6 goes into the proxy's expert 3, the same weights
    assert any(
        "expert 6 of decoder.layers.0.mlp injected into proxy expert 3" in n for n in reps[-1]["notes"]
    )
    # the token poison is put back on the dump's clean batch after the proxy's own old logprobs
    tokens = reps[0]
    assert any("clean batch" in n for n in tokens["notes"]), tokens["notes"]
    assert not any("differs from the dumped batch" in n for n in tokens["notes"]), tokens["notes"]


def test_token_poison_replays_exactly_on_the_original_and_goes_away_without_injection(run, reports):
    meta = json.loads((run / "run" / "dumps" / "step_000004" / "dump.json").read_text())
    exact, clean = reports["original"]
    assert exact["optimizer_steps"][0]["exact"], exact["optimizer_steps"]
    assert exact["optimizer_steps"][0]["replayed"]["loss"] == meta["optimizer_steps"][0]["loss"]
    assert types(exact["events"]) == types(meta["events"])
    # --no-inject: the clean batch, so the fault is gone, and nothing claims to be applied
    assert clean["injections"] == [] and clean["injections_in_batch"] == []
    assert clean["events"] == [], clean["events"]
    assert any("the poison is left out" in n for n in clean["notes"]), clean["notes"]


def test_a_dump_without_its_clean_batch_keeps_the_dumped_old_logprobs_and_says_so(reports):
    rep, no_inject = reports["bare"]
    assert rep["injections"] == [] and rep["injections_in_batch"] == ["poison"]
    assert any("old logprobs kept from the dump" in n for n in rep["notes"]), rep["notes"]
    assert "loss_spike" in types(rep["events"]), rep["events"]
    # without a clean batch the poison cannot be taken out: said, not hidden
    assert no_inject["injections_in_batch"] == ["poison"]
    assert any("cannot be removed" in n for n in no_inject["notes"]), no_inject["notes"]


def test_a_fault_in_an_expert_the_proxy_pruned_is_refused_not_dropped(reports):
    on_original, on_proxy = reports["expert"]
    assert "error" not in on_original, on_original
    assert on_original["injections"] == ["nan"] and "nonfinite" in types(on_original["events"])
    err = on_proxy["error"]
    assert "cannot be applied on" in err and "local_experts.6" in err and "--no-inject" in err, err


def test_a_proxy_prunes_from_a_dumps_weights_with_the_runs_tokenizer(run, tmp_path):
    from megarl.proxy.prune import prune_moe_checkpoint

    weights = run / "run" / "dumps" / "step_000004" / "weights"
    calib = [f"R {a}{b}{c}={c}{b}{a}" for a in "1357" for b in "02468" for c in "159"]
    rep = prune_moe_checkpoint(str(weights), str(tmp_path / "proxy"), 4, calib)
    assert rep["num_experts"] == {"original": 8, "proxy": 4}
    assert (tmp_path / "proxy" / "tokenizer.json").is_file()
    assert not (weights / "proxy_report.json").exists()


def test_a_proxy_not_pruned_from_the_dumps_weights_is_named_in_a_note(reports):
    notes = reports["step0"]["notes"]
    want = "does not hold the dump's pre-step backbone (model.norm.weight differs)"
    assert any(want in n for n in notes), notes
