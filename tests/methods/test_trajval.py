"""TrajVal: learnability, prior and combination equal reference/allocation.py's; the spec's
invariants (beta = 0 and equal learnability give uniform, the prior sums to 1, a uniform online
scheduler returns the prior, a task without gain keeps only the floor mass); the probe valuation
from a metrics file, the per-task evaluation it reads, and the prompt chooser's task counts."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.methods.allocation.pac import counts_for
from megarl.methods.allocation.trajval import (
    TrajValChooser,
    TrajValKnobs,
    combine,
    learnability,
    prior,
    read_prior,
    value_probe,
)
from megarl.methods.allocation.trajval_cli import main
from megarl.plugin.allocation import GroupOutcome
from megarl.plugin.knobs import build_knobs
from reference import allocation as ref

FAST = settings(max_examples=20, deadline=None)
acc = st.floats(0.0, 1.0)


@FAST
@given(a0=acc, a1=acc, n=st.integers(1, 500), n0=st.floats(0, 50), head=st.booleans())
def test_learnability_equals_reference(a0, a1, n, n0, head):
    assert learnability(a0, a1, n, head, 1e-3, n0) == pytest.approx(
        ref.trajval_learnability(a0, a1, n, head, 1e-3, n0), rel=1e-12, abs=1e-15
    )


@FAST
@given(ell=st.lists(st.floats(0, 5), min_size=1, max_size=6), beta=st.floats(0, 4), eps0=st.floats(1e-4, 1))
def test_prior_equals_reference_and_sums_to_one(ell, beta, eps0):
    tasks = {f"t{i}": x for i, x in enumerate(ell)}
    pi = prior(tasks, beta, eps0)
    assert list(pi.values()) == pytest.approx(ref.trajval_prior(ell, beta, eps0), rel=1e-9)
    assert sum(pi.values()) == pytest.approx(1.0, abs=1e-12)
    if beta == 0 or len(set(ell)) == 1:
        assert list(pi.values()) == pytest.approx([1 / len(ell)] * len(ell), rel=1e-12)


@FAST
@given(ell=st.lists(st.floats(0, 5), min_size=2, max_size=6), s=st.floats(0.1, 10))
def test_a_uniform_online_scheduler_returns_the_prior(ell, s):
    pi = prior({f"t{i}": x for i, x in enumerate(ell)})
    assert combine(dict.fromkeys(pi, s), pi) == pytest.approx(pi, rel=1e-12)
    scores = [s * (i + 1) for i in range(len(ell))]
    got = combine(dict(zip(pi, scores)), pi)
    assert list(got.values()) == pytest.approx(ref.trajval_combine(scores, list(pi.values())), rel=1e-12)


def test_a_task_without_gain_keeps_only_the_floor_mass():
    ell = {
        "flat": learnability(0.4, 0.3, 100),
        "up": learnability(0.2, 0.6, 100),
        "same": learnability(0.5, 0.5, 100),
    }
    assert ell["flat"] == ell["same"] == 0.0
    pi = prior(ell, beta=2.0, eps0=0.01)
    z = 0.01**2 * 2 + (ell["up"] + 0.01) ** 2
    assert pi["flat"] == pytest.approx(0.01**2 / z) and pi["up"] == pytest.approx((ell["up"] + 0.01) ** 2 / z)


def write_probe(run_dir, evals):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step, accs in evals:
        rec = {"step": step, "eval/sampled_acc": 0.0}
        for t, a in accs.items():
            rec[f"eval/task/{t}/sampled_acc"] = a
            rec[f"eval/task/{t}/samples"] = 240.0
        lines.append(json.dumps(rec))
        lines.append(json.dumps({"step": step + 1, "train/loss": 0.1}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_probe_valuation_reads_the_first_and_last_evaluation(tmp_path, capsys):
    write_probe(
        tmp_path / "probe",
        [
            (0, {"add": 0.02, "copy": 0.5, "reverse": 0.1}),
            (5, {"add": 0.0, "copy": 0.6, "reverse": 0.3}),
            (10, {"add": 0.01, "copy": 0.9, "reverse": 0.4}),
        ],
    )
    d = value_probe(tmp_path / "probe", beta=1.0, eps0=0.01, n0=60.0)
    t = d["tasks"]
    assert (t["copy"]["acc0"], t["copy"]["acc1"], t["copy"]["n_eval"]) == (0.5, 0.9, 240.0)
    assert t["add"]["learnability"] == 0.0
    assert t["reverse"]["learnability"] == pytest.approx(
        ref.trajval_learnability(0.1, 0.4, 240, True, 1e-3, 60)
    )
    assert [t[k]["prior"] for k in ("add", "copy", "reverse")] == pytest.approx(
        ref.trajval_prior([t[k]["learnability"] for k in ("add", "copy", "reverse")], 1.0, 0.01)
    )
    out = tmp_path / "prior.json"
    assert main([str(tmp_path / "probe"), "--out", str(out), "--n0", "60"]) == 0
    assert read_prior(str(out)) == {k: v["prior"] for k, v in t.items()}
    assert "reverse: acc 0.100 -> 0.400" in capsys.readouterr().out


def test_bad_probe_and_prior_files_are_named(tmp_path):
    write_probe(tmp_path / "one", [(0, {"a": 0.1, "b": 0.2})])
    with pytest.raises(ValueError, match=r"one/metrics.jsonl: 1 evaluation\(s\) with per-task accuracies"):
        value_probe(tmp_path / "one")
    (tmp_path / "bad.json").write_text('{"tasks": {"a": {"learnability": 1}}}')
    with pytest.raises(ValueError, match=r"bad.json: not a TrajVal prior file"):
        read_prior(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="no such file"):
        read_prior(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="prior is empty"):
        build_knobs(TrajValKnobs, {}, "method")


def test_per_task_evaluation_metrics():
    import torch

    from megarl.data.dataset import PromptRow
    from megarl.trainer.evaluation import eval_text, per_task

    rows = [PromptRow("p", "a", t, "m") for t in ("copy", "add", "copy", "add", "add")]
    ck = torch.tensor([[1, 1], [0, 0], [1, 0], [0, 1], [0, 0]], dtype=torch.bool)
    out = per_task(rows, ck)
    assert out == {
        "eval/task/add/sampled_acc": pytest.approx(1 / 6),
        "eval/task/add/samples": 6.0,
        "eval/task/copy/sampled_acc": 0.75,
        "eval/task/copy/samples": 4.0,
    }
    assert per_task(rows[:1], ck[:1]) == {}  # one task: nothing extra
    assert "task" not in eval_text({"eval/pass@1": 0.5, **out})


def chooser(pi, online=False, n_rows=(30, 20, 10)):
    tasks = [t for t, n in zip(("add", "copy", "reverse"), n_rows) for _ in range(n)]
    c = TrajValChooser(build_knobs(TrajValKnobs, {"prior": "x.json", "online": online}, "method"), 8, pi)
    c.bind(tasks, seed=3)
    return c, tasks


def test_static_chooser_gives_tasks_their_prior_share():
    pi = {"add": 0.1, "copy": 0.3, "reverse": 0.6}
    c, tasks = chooser(pi)
    for step in (1, 2):
        uids = c.next_prompts(step, 10)
        got = [sum(1 for u in uids if tasks[u] == t) for t in ("add", "copy", "reverse")]
        assert got == counts_for([0.1, 0.3, 0.6], 10) == [1, 3, 6]
    m = c.observe(2, [GroupOutcome(u, tasks[u], (1.0, 0.0)) for u in uids])
    assert m == {"trajval/add/prompts": 1.0, "trajval/copy/prompts": 3.0, "trajval/reverse/prompts": 6.0}
    assert c.stats == {}  # the static prior keeps no online statistics
    again, _ = chooser(pi)
    again.next_prompts(1, 10)
    assert again.next_prompts(2, 10) == uids  # seeded: a resumed run picks the same rows


def test_online_chooser_multiplies_pac_probabilities_by_the_prior():
    pi = {"add": 0.2, "copy": 0.3, "reverse": 0.5}
    c, _ = chooser(pi, online=True)
    c.next_prompts(1, 8)
    c.observe(1, [GroupOutcome(0, "add", (1.0, 0.0)), GroupOutcome(30, "copy", (1.0, 1.0))])
    draws = [0.3, -1.0, 0.5]
    from megarl.methods.allocation.pac import PACAllocator

    pac = PACAllocator.probabilities(c, draws)
    want = ref.trajval_combine(pac, [0.2, 0.3, 0.5])
    assert c.probabilities(draws) == pytest.approx(want, rel=1e-12)
    assert math.isclose(sum(c.probabilities(draws)), 1.0)


def test_a_dataset_task_without_a_prior_is_named():
    with pytest.raises(ValueError, match=r"no prior for the dataset's tasks \['reverse'\]"):
        chooser({"add": 0.5, "copy": 0.5})
