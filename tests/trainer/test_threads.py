"""The torch thread count of a ``megarl train`` process: MEGARL_NUM_THREADS, else cores / local ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.trainer.threads import ENV_VAR, ThreadsError, set_torch_threads, torch_threads
from megarl.trainer.train_cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_the_variable_wins_over_the_default():
    assert torch_threads({ENV_VAR: "3"}, cores=16) == 3
    assert torch_threads({ENV_VAR: " 1 ", "LOCAL_WORLD_SIZE": "1"}, cores=2) == 1


@pytest.mark.parametrize(
    "local, cores, expected",
    [(None, 2, 2), ("2", 2, 1), ("4", 16, 4), ("3", 16, 5), ("8", 2, 1), ("", 6, 6), ("x", 6, 6)],
)
def test_unset_the_cores_are_shared_among_the_local_ranks(local, cores, expected):
    env = {} if local is None else {"LOCAL_WORLD_SIZE": local}
    assert torch_threads(env, cores) == expected


@pytest.mark.parametrize("raw", ["0", "-2", "two", "1.5"])
def test_a_bad_value_names_the_variable(raw):
    with pytest.raises(ThreadsError, match=f"{ENV_VAR}='{raw}'"):
        torch_threads({ENV_VAR: raw}, cores=2)


def test_set_torch_threads_sets_torch():
    before = torch.get_num_threads()
    try:
        assert set_torch_threads({ENV_VAR: "2"}) == 2 and torch.get_num_threads() == 2
        assert set_torch_threads({ENV_VAR: "1"}) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_megarl_train_refuses_a_bad_value_before_building_anything(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv(ENV_VAR, "many")
    before = torch.get_num_threads()
    code = main(["examples/quickstart.yaml", f"logging.run_dir={tmp_path / 'run'}"])
    assert code == 2 and f"{ENV_VAR}='many'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and torch.get_num_threads() == before
