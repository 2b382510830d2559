"""The proxy loads into the Megatron learner at EP=2 (torchrun, 2 processes, gloo): logprobs equal
transformers' on the same directory and the export is bit-exact (tests/proxy/dist_proxy.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_proxy_round_trip_through_converter_at_ep2(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        os.path.join(HERE, "dist_proxy.py"),
        "--workdir",
        str(tmp_path),
    ]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result (rc={proc.returncode}):\n{proc.stderr[-5000:]}"
    res = json.loads(lines[-1][7:])
    print(json.dumps(res))  # the measured figures, shown with -s
    assert res["ok"], json.dumps(res, indent=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
