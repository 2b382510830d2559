"""``megarl proxy compare`` at the layout the fault happened in: both runs under torchrun with
expert parallelism (2 processes, EP=2), or the proxy at a smaller layout than the original; a
proxy layout the proxy cannot take is refused before any run."""

import json
from pathlib import Path

import pytest

from tests.faults.tiny_moe import make_moe_dir, slice_experts

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "tests" / "faults" / "recipe.yaml"


def data(tmp: Path) -> list[str]:
    from megarl.data.tasks import generate_task_files

    generate_task_files(
        train_path=str(tmp / "train.jsonl"),
        eval_path=str(tmp / "eval.jsonl"),
        task="reverse",
        digits=3,
        num_train=200,
        num_eval=8,
        seed=0,
    )
    return [f"data.train={tmp / 'train.jsonl'}", f"data.eval={tmp / 'eval.jsonl'}"]


def test_a_proxy_layout_the_proxy_cannot_take_is_refused_before_any_run(tmp_path):
    from megarl.proxy.compare import CompareError, run_compare

    orig = make_moe_dir(tmp_path / "orig")
    proxy = slice_experts(orig, tmp_path / "proxy", [0, 3, 5])  # 3 experts: EP=2 cannot split them
    with pytest.raises(CompareError, match=r"--proxy-set.*parallel\.ep=2 must divide num_experts=3"):
        run_compare(
            str(RECIPE),
            str(orig),
            str(proxy),
            2,
            str(tmp_path / "cmp"),
            data(tmp_path),
            nproc_per_node=2,
            proxy_overrides=["parallel.ep=2"],
        )
    assert not (tmp_path / "cmp" / "original").exists()


@pytest.mark.slow
def test_compare_runs_both_models_under_torchrun_at_ep2(tmp_path):
    from megarl.proxy.compare import run_compare

    orig = make_moe_dir(tmp_path / "orig")
    proxy = slice_experts(orig, tmp_path / "proxy", [0, 2, 4, 6])
    # NaN in the weights of routed expert 6 for step 2: held by EP rank 1 of the original (experts
    # 4-7) and, as proxy expert 3, by EP rank 1 of the proxy (experts 2-3); the other rank does nothing
    fault = "faults.inject=[{kind: nan, where: weight, target: decoder.layers.0.mlp, expert: %d, step: 2}]"
    rep = run_compare(
        str(RECIPE),
        str(orig),
        str(proxy),
        3,
        str(tmp_path / "cmp"),
        [
            *data(tmp_path),
            "parallel.ep=2",
            "faults.dump_steps=[2]",
            "faults.dump_learner_state=false",
            fault % 6,
        ],
        nproc_per_node=2,
        parallel=True,
        proxy_overrides=[fault % 3],
    )
    for name in ("original", "proxy"):
        assert rep["runs"][name]["nproc_per_node"] == 2
        lay = json.loads((tmp_path / "cmp" / name / "dumps" / "step_000002" / "dump.json").read_text())[
            "layout"
        ]
        assert lay["world_size"] == 2 and lay["ep"] == 2, lay
    for name in ("original", "proxy"):
        assert rep["events"][name] == [(2, "nonfinite")], rep["events"]
        # the weights came back after step 2: step 3 trains normally
        last = json.loads((tmp_path / "cmp" / name / "metrics.jsonl").read_text().splitlines()[-1])
        assert last["step"] == 3 and last["train/update_successful"] == 1.0, last
