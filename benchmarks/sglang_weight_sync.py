"""Weight-sync time into a real SGLang CPU server: disk vs in memory (tiny random Qwen3 models).

One SGLang 0.5.23 server per model size (the venv of tests/setup/40-sglang.sh, ``device="cpu"``),
the two paths on the same server in the same run, as benchmarks/rollout_vllm.py does for vLLM:
disk = write the safetensors checkpoint, then ``/update_weights_from_disk``; memory = the same
tensors over the gloo group (``/update_weights_from_distributed``, one call per 256 MiB bucket).
Prints JSON lines with the medians and the ratio memory / disk.

Usage: .venv/bin/python benchmarks/sglang_weight_sync.py [--sizes small,large] [--out FILE]
Without the SGLang venv it prints one line saying so and exits 0 (``make bench`` runs every file).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from rollout_vllm import SIZES, _state, disk_sync_times, emit, memory_sync_times

from megarl.rollout.server_process import SGLangServerConfig, default_sglang_python, launch_sglang
from megarl.testing.tiny_qwen3 import build_tiny_qwen3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="small,large")
    p.add_argument("--out", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=4)
    args = p.parse_args()
    python = default_sglang_python()
    if not Path(python).exists():
        print(f"sglang_weight_sync: skipped, no SGLang python at {python} (bash tests/setup/40-sglang.sh)")
        return
    work = Path(tempfile.mkdtemp(prefix="megarl-bench-sglang-"))
    emit(
        args.out,
        bench="env",
        engine="sglang",
        cpus=os.cpu_count(),
        load_avg=os.getloadavg(),
        dtype=args.dtype,
    )
    for size in args.sizes.split(","):
        a = build_tiny_qwen3(work / f"{size}-a", seed=0, config_overrides=SIZES[size])
        b = build_tiny_qwen3(work / f"{size}-b", seed=1, config_overrides=SIZES[size])
        nbytes = sum(f.stat().st_size for f in a.glob("*.safetensors"))
        t0 = time.perf_counter()
        server = launch_sglang(
            SGLangServerConfig(
                model_dir=str(a),
                python=python,
                device="cpu",
                dtype=args.dtype,
                max_total_tokens=8192,
                work_dir=str(work / f"srv-{size}"),
                startup_timeout_s=900,
            )
        )
        start_s = time.perf_counter() - t0
        try:
            states = [_state(b), _state(a)]
            disk = asyncio.run(disk_sync_times(server, states, a, work / f"sync-{size}", args.repeats))
            memory = asyncio.run(memory_sync_times(server, states, args.repeats))
            emit(
                args.out,
                bench="sync",
                engine="sglang",
                model=size,
                checkpoint_mb=round(nbytes / 2**20, 2),
                server_start_s=round(start_s, 1),
                disk_write_and_reload_median_s=round(statistics.median(disk), 3),
                memory_sync_median_s=round(statistics.median(memory), 3),
                memory_over_disk=round(statistics.median(memory) / statistics.median(disk), 3),
            )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
