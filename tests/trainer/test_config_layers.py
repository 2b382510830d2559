"""Layered configs (``base:``) and data paths relative to the config file (config_layers.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megarl.trainer.config import ConfigError, load_config
from megarl.trainer.config_layers import merge_layers, read_layered_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples" / "methods").glob("*.yaml"))


def _write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_method_example_loads_as_written(path: Path):
    cfg = load_config(path)
    raw = yaml.safe_load(path.read_text())
    assert raw["base"] == "../quickstart.yaml"
    # the sections the example sets are the example's (a method that only adds a hook, an allocator
    # or an optimizer projection keeps the quickstart's objective)
    if "advantage" in raw:
        assert cfg.advantage.estimator == raw["advantage"]["estimator"]
    if "policy_loss" in raw.get("objective", {}):
        assert cfg.objective.policy_loss == raw["objective"]["policy_loss"]
    if "method" in raw:
        assert cfg.method["name"] == raw["method"]["name"]
    # the quickstart's sections the example does not set are the quickstart's
    assert cfg.schedule.steps == 60 and cfg.model.tokenizer == "char"
    assert Path(cfg.data.train) == ROOT / "examples" / "data" / "reverse3-train.jsonl"


def test_method_example_replaces_the_base_method_and_keeps_the_rest():
    d = read_layered_config(ROOT / "examples" / "methods" / "amrp.yaml")
    assert "base" not in d
    assert d["advantage"] == {"estimator": "grpo"}  # the quickstart's scale_by_std does not leak in
    assert "kl_coef" not in d["objective"]
    assert [f["name"] for f in d["reward"]["functions"]] == ["correct", "format"]  # list replaced whole
    assert d["reward"]["shaping"]["name"] == "amrp"
    assert d["rollout"]["n"] == 8 and d["warmup"]["sft_steps"] == 22


def test_merge_rules():
    base = {
        "a": {"x": 1, "y": {"p": 1}},
        "l": [1, 2],
        "advantage": {"estimator": "grpo", "scale_by_std": True},
    }
    over = {"a": {"y": {"q": 2}}, "l": [3], "advantage": {"scale_by_std": False}}
    assert merge_layers(base, over) == {
        "a": {"x": 1, "y": {"p": 1, "q": 2}},
        "l": [3],
        "advantage": {"estimator": "grpo", "scale_by_std": False},  # no estimator named: merged
    }
    named = merge_layers(base, {"advantage": {"estimator": "rloo"}, "objective": {"policy_loss": "gspo"}})
    assert named["advantage"] == {"estimator": "rloo"} and named["objective"] == {"policy_loss": "gspo"}
    assert base["a"] == {"x": 1, "y": {"p": 1}}  # inputs untouched


def test_base_chain_and_list_of_bases(tmp_path: Path):
    _write(tmp_path / "a.yaml", {"schedule": {"steps": 1, "seed": 5}})
    _write(tmp_path / "sub" / "b.yaml", {"base": "../a.yaml", "schedule": {"steps": 2}})
    _write(tmp_path / "c.yaml", {"schedule": {"eval_every": 3}})
    top = _write(tmp_path / "top.yaml", {"base": ["sub/b.yaml", "c.yaml"], "schedule": {"seed": 9}})
    assert read_layered_config(top) == {"schedule": {"steps": 2, "seed": 9, "eval_every": 3}}


def test_relative_data_paths_resolve_against_the_file_that_writes_them(tmp_path: Path, monkeypatch):
    base = _write(
        tmp_path / "conf" / "base.yaml", {"data": {"train": "d/train.jsonl", "eval": "/abs/eval.jsonl"}}
    )
    top = _write(
        tmp_path / "conf" / "methods" / "m.yaml", {"base": "../base.yaml", "data": {"eval": "e.jsonl"}}
    )
    monkeypatch.chdir(tmp_path)  # not the config's directory
    d = read_layered_config(Path("conf/methods/m.yaml"))
    assert d["data"]["train"] == str(base.parent / "d" / "train.jsonl")
    assert d["data"]["eval"] == str(top.parent / "e.jsonl")
    assert read_layered_config(base)["data"]["eval"] == "/abs/eval.jsonl"


def test_quickstart_data_is_found_from_any_directory(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "examples" / "quickstart.yaml", [f"logging.run_dir={tmp_path / 'run'}"])
    assert Path(cfg.data.train).is_file() and Path(cfg.data.eval).is_file()
    # an override typed on the command line stays relative to the working directory
    cfg = load_config(ROOT / "examples" / "quickstart.yaml", ["data.train=mine.jsonl"])
    assert cfg.data.train == "mine.jsonl"


def test_bad_bases_are_named(tmp_path: Path):
    top = _write(tmp_path / "top.yaml", {"base": "missing.yaml"})
    with pytest.raises(ConfigError, match=r"missing.yaml does not exist \(the base of .*top.yaml\)"):
        read_layered_config(top)
    _write(tmp_path / "x.yaml", {"base": "y.yaml"})
    _write(tmp_path / "y.yaml", {"base": "x.yaml"})
    with pytest.raises(ConfigError, match=r"cycle: .*x.yaml -> .*y.yaml -> .*x.yaml"):
        read_layered_config(tmp_path / "x.yaml")
    _write(tmp_path / "bad.yaml", {"base": 3})
    with pytest.raises(
        ConfigError, match=r"bad.yaml: base must be a config file path or a list of them, got 3"
    ):
        read_layered_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match=r"list.yaml: the config must be a mapping of sections, got list"):
        read_layered_config(tmp_path / "list.yaml")


def test_megarl_train_check_runs_a_method_example_as_written():
    r = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "train", "--check", "examples/methods/amrp.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "config OK" in r.stdout + r.stderr
