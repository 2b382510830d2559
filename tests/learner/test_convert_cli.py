"""``megarl convert``: HF <-> Megatron round trips (bit-exact), layouts, run checkpoints, bad input.

Conversions run in subprocesses (``python -m megarl.cli convert ...``, or torchrun), never in the
pytest process: a process group and megatron's globals would outlive the test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.learner.convert_helpers import make_tiny_hf, read_hf_tensors

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Qwen3 and Qwen3-MoE HF directories (fp32), made once."""
    d = tmp_path_factory.mktemp("convert")
    return {
        "dense": make_tiny_hf(d / "hf_dense", moe=False),
        "moe": make_tiny_hf(d / "hf_moe", moe=True, seed=1),
        "root": d,
    }


def _cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return _py("-m", "megarl.cli", "convert", *args, timeout=timeout)


def _py(*args, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout
    )


def _torchrun(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        *map(str, args),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout)


def _result(proc: subprocess.CompletedProcess) -> dict:
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(
        f"no RESULT line (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )


def _assert_bit_exact(a_dir: Path, b_dir: Path) -> int:
    a, b = read_hf_tensors(a_dir), read_hf_tensors(b_dir)
    assert sorted(a) == sorted(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, f"{len(bad)} tensors differ: {bad[:5]}"
    return len(a)


def _no_temp_left(parent: Path) -> None:
    left = [p.name for p in parent.iterdir() if "tmp" in p.name]
    assert not left, left


# ----------------------------------------------------------------------------- round trips
def test_roundtrip_one_process_dense(tiny):
    """HF -> Megatron -> HF in one process each, bit-exact; config kept; metadata says model-only;
    a wrong --hf-config for the checkpoint exits 2."""
    root = tiny["root"]
    ckpt, back = root / "mg_dense", root / "back_dense"
    p = _cli("hf-to-megatron", "--hf", tiny["dense"], "--out", ckpt)
    assert p.returncode == 0, p.stderr[-3000:]
    meta = json.loads((ckpt / "megarl.json").read_text())
    assert meta["contents"] == ["model"] and meta["layout"]["tp"] == 1
    assert meta["hf_config"]["model_type"] == "qwen3"
    p = _cli("megatron-to-hf", "--ckpt", ckpt, "--out", back)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert _assert_bit_exact(tiny["dense"], back) == 25
    cfg_in, cfg_out = (json.loads((d / "config.json").read_text()) for d in (tiny["dense"], back))
    assert cfg_out == cfg_in
    # the same checkpoint read with another architecture's config: exit 2, the key named
    (root / "wider.json").write_text(json.dumps(dict(cfg_in, intermediate_size=96)))
    p = _cli("megatron-to-hf", "--ckpt", ckpt, "--out", root / "bad", "--hf-config", root / "wider.json")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert f"{ckpt}: the model weights do not fit this model" in p.stderr
    assert "decoder.layers.mlp.linear_fc1.weight" in p.stderr
    _no_temp_left(root)


def test_torchrun_layouts_bit_exact(tiny):
    """Under torchrun (2 processes): MoE written at EP=2 read back at TP=2 (+SP), dense written at
    TP=2 read back at PP=2; and the 1-process dense checkpoint read at TP=2. All bit-exact."""
    root = tiny["root"]
    p = _torchrun(
        2,
        "-m",
        "megarl.cli",
        "convert",
        "hf-to-megatron",
        "--hf",
        tiny["moe"],
        "--out",
        root / "mg_moe_ep2",
        "--ep",
        "2",
    )
    assert p.returncode == 0, p.stderr[-5000:]
    assert json.loads((root / "mg_moe_ep2" / "megarl.json").read_text())["layout"]["ep"] == 2
    res = _result(
        _torchrun(
            2,
            HERE / "convert_helpers.py",
            "convert",
            "megatron-to-hf",
            "--ckpt",
            root / "mg_moe_ep2",
            "--out",
            root / "back_moe_tp2",
            "--tp",
            "2",
            "--",
            "hf-to-megatron",
            "--hf",
            tiny["dense"],
            "--out",
            root / "mg_dense_tp2",
            "--tp",
            "2",
            "--",
            "megatron-to-hf",
            "--ckpt",
            root / "mg_dense_tp2",
            "--out",
            root / "back_dense_pp2",
            "--pp",
            "2",
        )
    )
    assert res["rcs"] == [0, 0, 0], res
    assert _assert_bit_exact(tiny["moe"], root / "back_moe_tp2") == 45
    assert _assert_bit_exact(tiny["dense"], root / "back_dense_pp2") == 25
    _no_temp_left(root)


def test_run_checkpoint_to_hf(tiny, tmp_path):
    """A real run checkpoint (trained one step, Adam state, trainer.json) -> HF equals the trained
    weights bit-exactly, by step directory and by run directory; tokenizer-side files come from
    init_policy/; an existing output is refused without --overwrite."""
    run, ref, out = tmp_path / "run", tmp_path / "ref", tmp_path / "out"
    proc = _py(HERE / "convert_helpers.py", "run-ckpt", tiny["dense"], run, ref, out, timeout=300)
    res = _result(proc)
    step_dir = str(run / "checkpoints" / "step_000001")
    assert res == {"rc_step": 0, "rc_refuse": 2, "rc_run": 0, "step_dir": step_dir}
    assert "exists and is not empty" in proc.stderr
    _assert_bit_exact(ref, out)
    trained, start = read_hf_tensors(out), read_hf_tensors(tiny["dense"])
    assert any(not torch.equal(trained[k], start[k]) for k in start)  # the step changed the weights
    assert (out / "generation_config.json").is_file()
    _no_temp_left(tmp_path)


def test_weights_only_checkpoint_loads_into_a_fresh_optimizer(tiny, tmp_path):
    """load_checkpoint on an hf-to-megatron output loads the weights and refreshes the optimizer's main
    parameters: one train step after it equals one after load_hf bit for bit (a stale main copy from
    the random init would be written back by the step)."""
    a, b = tmp_path / "via_ckpt", tmp_path / "via_hf"
    proc = _py(HERE / "convert_helpers.py", "model-only-load", tiny["dense"], tmp_path / "ckpt", a, b)
    res = _result(proc)
    assert res == {"rc": 0, "optimizer_restored": False, "step": 0}, proc.stderr[-2000:]
    assert _assert_bit_exact(a, b) > 0
    trained, start = read_hf_tensors(a), read_hf_tensors(tiny["dense"])
    moved = [k for k in start if not torch.equal(trained[k], start[k].to(trained[k].dtype))]
    assert moved  # the step moved the weights


# ----------------------------------------------------------------------------- bad input
def test_missing_path_exits_2_without_traceback(tmp_path):
    missing = tmp_path / "no_such_model"
    p = _cli("hf-to-megatron", "--hf", missing, "--out", tmp_path / "out", timeout=120)
    assert p.returncode == 2
    assert str(missing) in p.stderr and "no such directory" in p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "case", ["no_config", "no_ckpt", "not_a_ckpt", "tp3", "pp3", "ep_dense", "out_not_empty", "bad_hf_config"]
)
def test_bad_input_exit_2(tiny, tmp_path, capsys, case):
    """Checked before any process group starts: exit 2, a message naming the path or value."""
    from megarl.convert.convert_cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    argv, want = {
        "no_config": (["hf-to-megatron", "--hf", empty, "--out", out], f"{empty}: no config.json"),
        "no_ckpt": (
            ["megatron-to-hf", "--ckpt", tmp_path / "nope", "--out", out],
            f"{tmp_path / 'nope'}: no such",
        ),
        "not_a_ckpt": (
            ["megatron-to-hf", "--ckpt", empty, "--out", out],
            f"{empty}: not a Megatron checkpoint",
        ),
        "tp3": (["hf-to-megatron", "--hf", tiny["dense"], "--out", out, "--tp", "3"], "divisible by --tp 3"),
        "pp3": (
            ["hf-to-megatron", "--hf", tiny["dense"], "--out", out, "--pp", "3"],
            "num_hidden_layers 2 is not divisible by --pp 3",
        ),
        "ep_dense": (
            ["hf-to-megatron", "--hf", tiny["dense"], "--out", out, "--ep", "2"],
            "needs a MoE model",
        ),
        "out_not_empty": (
            ["hf-to-megatron", "--hf", tiny["dense"], "--out", tiny["moe"]],
            f"{tiny['moe']}: exists and is not empty (pass --overwrite",
        ),
        "bad_hf_config": (
            ["megatron-to-hf", "--ckpt", empty, "--out", out, "--hf-config", tmp_path / "cfg.json"],
            f"{tmp_path / 'cfg.json'}: no such file",
        ),
    }[case]
    if case == "bad_hf_config":
        (empty / "megarl.json").write_text("{}")  # looks like a checkpoint: the config is checked next
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert want in err, err
    assert not out.exists()


def test_help_explains_both_directions():
    p = _cli("megatron-to-hf", "--help", timeout=60)
    assert p.returncode == 0
    for word in ("--ckpt", "--hf-config", "run checkpoint", "optimizer", "--tp", "--overwrite"):
        assert word in p.stdout
    top = _py("-m", "megarl.cli", "--help", timeout=60)
    assert "convert" in top.stdout
