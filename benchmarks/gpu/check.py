"""The prepared GPU check: what of megarl's GPU path works on this machine, one line per check.

Run through ``benchmarks/gpu/check.sh`` (which picks the Python and skips without a GPU). On a GPU:
the learner in bf16 with the Transformer Engine layer spec where TE is installed (else megatron's
local spec), THD packing, grouped-GEMM experts; logprob parity of a tiny Qwen3 and a tiny Qwen3-MoE
against HF transformers; packed rows against one sequence at a time; the fused output layer against
the unfused one; the learner step's time, MFU and peak memory on a larger dense model; then a short
GRPO run with a vLLM server on the same GPU and in-memory weight sync (when a vLLM venv exists),
and, with two GPUs, the in-memory sync over NCCL to a vLLM server on the second GPU.
``--device cpu`` runs the same checks in fp32 on the CPU path (how CI keeps this script working).
Exit status: 1 when a parity check or the NCCL sync check fails, 0 otherwise (a skipped check is
printed as skipped).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# dense bf16 peak of the GPU (TFLOP/s, no sparsity), for the MFU line
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def line(name: str, text: str) -> None:
    """One result line."""
    print(f"{name:<18} {text}", flush=True)


def tiny_config(moe: bool, vocab: int = 1024) -> dict:
    """A tiny Qwen3 (or Qwen3-MoE) config for the parity checks."""
    cfg = dict(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
    )
    if moe:
        cfg.update(moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    return cfg


def save_hf(moe: bool, workdir: str, dtype: torch.dtype, device: str, **overrides):
    """A random-weight HF model saved to ``workdir``; returns (model on device, its directory)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(1 if moe else 0)
    cfg = {**tiny_config(moe), **overrides}
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)) if moe else Qwen3ForCausalLM(Qwen3Config(**cfg))
    d = os.path.join(workdir, ("moe" if moe else "dense") + f"-{cfg['hidden_size']}")
    model.save_pretrained(d)
    return model.to(device=device, dtype=dtype).eval(), d


def packed_batch(lens: list[int], vocab: int, seed: int = 0):
    """A packed batch of random tokens (every response token in the loss)."""
    from megarl.batch import PackedBatch

    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    mask = torch.ones(T)
    mask[cu[:-1]] = 0.0
    return PackedBatch(
        tokens=torch.randint(0, vocab, (T,), generator=g),
        cu_seqlens=cu,
        prompt_lens=torch.ones(len(lens), dtype=torch.long),
        loss_mask=mask,
        group_ids=torch.arange(len(lens)),
        advantages=torch.randn(T, generator=g),
    ).validate()


def hf_logprobs(hf, batch, device: str) -> torch.Tensor:
    """HF logprobs of every token given its prefix, aligned like megarl's (0 at sequence starts)."""
    out = torch.zeros(batch.num_tokens, dtype=torch.float32)
    cu = batch.cu_seqlens.tolist()
    with torch.no_grad():
        for a, b in itertools.pairwise(cu):
            ids = batch.tokens[a:b].to(device)
            logits = hf(ids[None]).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
            out[a + 1 : b] = lp.cpu()
    return out


def learner_for(hf_dir: str, dtype: torch.dtype, **cfg):
    """A single-rank megarl learner loaded from ``hf_dir``."""
    from megarl.learner.learner import Learner, LearnerConfig
    from megarl.learner.optim_config import OptimConfig
    from megarl.learner.parallel import ParallelLayout, initialize_parallel

    groups = initialize_parallel(ParallelLayout())
    ln = Learner(
        LearnerConfig(hf_config=hf_dir, optim=OptimConfig(lr=1e-5), params_dtype=dtype, **cfg), groups
    )
    ln.load_hf(hf_dir)
    return ln


def check_parity(moe: bool, workdir: str, dtype: torch.dtype, device: str, tol: float) -> bool:
    """megarl's logprobs of a packed batch vs HF's, and packed vs one sequence at a time."""
    from megarl.learner.model import uses_te_spec

    hf, d = save_hf(moe, workdir, dtype, device)
    ln = learner_for(d, dtype)
    batch = packed_batch([37, 120, 5, 64, 200], 1024, seed=int(moe))
    lp, _ = ln.compute_logprobs(batch)
    ref = hf_logprobs(hf, batch, device)
    diff = float((lp.float().cpu() - ref).abs().max())
    singles = torch.cat(
        [ln.compute_logprobs(batch.select([i]))[0].float().cpu() for i in range(batch.num_seqs)]
    )
    packed = float((lp.float().cpu() - singles).abs().max())
    ok = diff <= tol and packed <= tol
    spec = "TE spec, THD" if uses_te_spec() else "local spec"
    name = "parity moe" if moe else "parity dense"
    line(
        name,
        f"max |logp - HF| {diff:.2e}, packed vs single {packed:.2e} (tol {tol:g}; {spec}) "
        + ("OK" if ok else "FAIL"),
    )
    fused_ok = check_fused(ln, batch, lp, tol) if not moe else True
    del ln
    return ok and fused_ok


def check_fused(ln, batch, lp, tol: float) -> bool:
    """The fused output layer (logprobs from hidden states in chunks) vs the unfused logits path."""
    fused = getattr(ln, "fused", None)
    if fused is None or not hasattr(fused, "mode"):
        line("fused output", "skipped: this megarl has no fused output layer")
        return True
    saved = fused.mode
    try:
        fused.mode = "off"
        ref, _ = ln.compute_logprobs(batch)
        fused.mode = "on"
        got, _ = ln.compute_logprobs(batch)
    finally:
        fused.mode = saved
    diff = float((got.float() - ref.float()).abs().max())
    ok = diff <= tol
    line("fused output", f"max |logp fused - unfused| {diff:.2e} (tol {tol:g}) {'OK' if ok else 'FAIL'}")
    return ok


def check_step(workdir: str, dtype: torch.dtype, device: str, tokens: int, hidden: int, layers: int) -> None:
    """Median train-step time, MFU (6 N T / time / peak) and peak memory of a larger dense model."""
    _, d = save_hf(
        False,
        workdir,
        dtype,
        "cpu",
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        head_dim=64,
        vocab_size=32768,
        max_position_embeddings=4096,
    )
    ln = learner_for(d, dtype)
    n_params = sum(p.numel() for p in ln.model.parameters())
    batch = packed_batch([tokens // 8] * 8, 32768, seed=3)
    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ln.train_step(batch, PGObjective())
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    flops = 6.0 * n_params * tokens / step
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    mfu = f"MFU {100 * flops / (peak * 1e12):.1f}% of {peak:g} TFLOP/s" if peak else "MFU: peak unknown"
    line(
        "learner step",
        f"{n_params / 1e6:.0f}M params, {tokens} tokens: {step * 1e3:.0f} ms, "
        f"{flops / 1e12:.1f} TFLOP/s, {mfu}",
    )
    if device == "cuda":
        line("peak memory", f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB (learner step)")
    del ln


class PGObjective:
    """Token-mean policy gradient (the check's training objective)."""

    def __call__(self, logits, batch, ctx):
        from megarl.objectives.api import LossOutput
        from megarl.ops.vocab_parallel import vocab_parallel_logprobs_entropy

        lp, _ = vocab_parallel_logprobs_entropy(
            logits, batch.tokens.to(logits.device), ctx.tp_group, ctx.chunk_tokens
        )
        m = batch.loss_mask.to(lp)
        loss = -(lp * batch.advantages.to(lp) * m).sum() / ctx.normalisers.num_tokens
        return LossOutput(loss=loss, metrics={})


def vllm_python() -> str | None:
    """The vLLM venv's python the launcher would use (MEGARL_VLLM_PYTHON, else .venv-vllm), if it
    exists."""
    from megarl.rollout.server_process import default_vllm_python

    py = default_vllm_python()
    return py if Path(py).exists() else None


def check_grpo_vllm(workdir: str, device: str, steps: int) -> None:
    """A short GRPO run of the quickstart with a vLLM server launched on this machine, weights sent in
    memory (over gloo: the server shares the learner's GPU, the channel is read from the server's
    log); prints generation tokens/s and the weight-sync time from the run's metrics."""
    py = vllm_python()
    if py is None:
        line("grpo + vllm", "skipped: no vLLM venv (MEGARL_VLLM_PYTHON or .venv-vllm)")
        return
    run_dir = os.path.join(workdir, "grpo-vllm")
    dtype = "bfloat16" if device == "cuda" else "float32"
    cmd = [sys.executable, "-m", "megarl.cli", "train", "examples/quickstart-vllm.yaml", "parallel.tp=1",
           f"model.params_dtype={dtype}", f"rollout.server_dtype={dtype}", f"rollout.server_python={py}",
           "rollout.weight_sync=memory", f"schedule.steps={steps}", "schedule.eval_every=0",
           "logging.plot=false", f"logging.run_dir={run_dir}"]  # fmt: skip
    if device == "cuda":  # leave most of the GPU to the learner
        cmd.append('rollout.server_args=["--gpu-memory-utilization", "0.3"]')
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        line("grpo + vllm", f"FAILED (exit {res.returncode}): {res.stderr.strip().splitlines()[-1:]}")
        return
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl")) if '"time/step"' in x]
    tok = statistics.median(r["perf/rollout_tokens_per_s"] for r in rows if "perf/rollout_tokens_per_s" in r)
    sync = statistics.median(r["time/sync"] for r in rows if "time/sync" in r)
    # the run's server shares the learner's GPU, where NCCL cannot go (two ranks on one GPU): gloo
    channel = sync_channel(os.path.join(run_dir, "vllm-server", "server.log"))
    if channel != "gloo":
        line("grpo + vllm", f"FAILED: weight sync channel {channel or 'not found'}, expected gloo")
        return
    line(
        "grpo + vllm",
        f"{len(rows)} steps in {time.perf_counter() - t0:.0f} s; generation {tok:.0f} tok/s; "
        f"weight sync ({channel}) {sync * 1e3:.1f} ms",
    )


def sync_channel(log_path: str) -> str | None:
    """The backend of the in-memory weight channel the vLLM server's workers joined (the receiver
    logs "joined the trainer's <backend> channel"), or None."""
    found = None
    if os.path.exists(log_path):
        for text in open(log_path, errors="replace"):
            if "megarl_vllm_receiver:" in text and "joined the trainer's " in text:
                found = text.split("joined the trainer's ", 1)[1].split()[0]
    return found


def check_nccl_sync(workdir: str, device: str) -> bool:
    """The in-memory weight sync to vLLM over NCCL: a server on the second GPU (NCCL cannot put two
    ranks on one GPU), the trainer's tensors on the first. Greedy tokens after the in-memory sync
    must equal those after a disk reload of the same weights, and syncing the first weights back
    must restore the first tokens; prints the channel's backend and the sync time next to a disk
    write + reload. Returns False on a mismatch or a failed sync."""
    name = "nccl sync"
    if device != "cuda":
        line(name, "skipped: needs CUDA")
        return True
    if torch.cuda.device_count() < 2:
        line(name, "skipped: needs two GPUs (NCCL cannot put the trainer and the server on one GPU)")
        return True
    py = vllm_python()
    if py is None:
        line(name, "skipped: no vLLM venv (MEGARL_VLLM_PYTHON or .venv-vllm)")
        return True
    import asyncio

    from safetensors.torch import load_file, save_file

    from megarl.rollout.server_process import VLLMServerConfig, launch_vllm
    from megarl.rollout.types import SamplingParams
    from megarl.testing.tiny_qwen3 import build_tiny_qwen3

    root = Path(workdir) / "nccl-sync"
    v1, v2 = build_tiny_qwen3(root / "v1", seed=0), build_tiny_qwen3(root / "v2", seed=1)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    second = visible[1] if len(visible) > 1 else "1"  # the physical id of this process's cuda:1
    torch.cuda.set_device(0)
    cfg = VLLMServerConfig(
        model_dir=str(v1), python=py, served_model_name="tiny", dtype="bfloat16",
        work_dir=str(root / "server"), extra_env={"CUDA_VISIBLE_DEVICES": second},
        extra_args=["--gpu-memory-utilization", "0.3"], startup_timeout_s=300,
    )  # fmt: skip
    state = {k: load_file(str(v / "model.safetensors"), device="cuda:0") for k, v in (("v1", v1), ("v2", v2))}
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    prompt = list(range(5, 25))

    async def go(eng) -> tuple[bool, str]:
        async def tokens() -> list:
            return (await eng.generate(prompt, sampling=greedy)).samples[0].token_ids

        t1 = await tokens()
        await eng.update_weights_from_tensors(state["v2"], "m2")  # opens the channel
        m2 = await tokens()
        await eng.update_weights_from_tensors(state["v1"], "m1")
        back = await tokens()
        t0 = time.perf_counter()
        await eng.update_weights_from_tensors(state["v2"], "m2b")
        t_mem = time.perf_counter() - t0
        disk = root / "v2-disk"
        t0 = time.perf_counter()
        disk.mkdir(exist_ok=True)
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            if (v2 / f).exists():
                (disk / f).write_bytes((v2 / f).read_bytes())
        save_file({k: t.cpu() for k, t in state["v2"].items()}, str(disk / "model.safetensors"))
        await eng.update_weights(str(disk), "d2")
        t_disk = time.perf_counter() - t0
        d2 = await tokens()
        ok = m2 == d2 and back == t1
        backend = eng._channel.backend
        what = "equal" if ok else f"DIFFER (memory {m2}, disk {d2}, restored {back == t1})"
        return ok and backend == "nccl", (
            f"backend {backend}; greedy tokens after the sync and after a disk reload {what}; "
            f"sync {t_mem * 1e3:.1f} ms, disk write + reload {t_disk * 1e3:.1f} ms"
        )

    try:
        server = launch_vllm(cfg)
    except Exception as e:  # a server that does not start is a failed check, printed
        line(name, f"FAILED: the vLLM server did not start ({str(e).splitlines()[0]})")
        return False
    try:

        async def run() -> tuple[bool, str]:
            async with server.client() as eng:
                return await go(eng)

        ok, text = asyncio.run(run())
    except Exception as e:
        ok, text = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        server.stop()
    line(name, text if ok else f"FAILED: {text}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--workdir", default=None)
    ap.add_argument(
        "--step-tokens", type=int, default=None, help="tokens of the timed step (cuda 16384, cpu 512)"
    )
    ap.add_argument("--grpo-steps", type=int, default=20)
    ap.add_argument("--skip", default="", help="comma list of: parity, step, sync, grpo")
    args = ap.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cpu":
        os.environ["MEGARL_FORCE_CPU"] = "1"
    elif not torch.cuda.is_available():
        print("benchmarks/gpu/check.py: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 0.25 if dtype == torch.bfloat16 else 1e-4
    workdir = args.workdir or tempfile.mkdtemp(prefix="megarl-gpu-check-")
    versions = {"torch": torch.__version__}
    for mod in ("megatron.core", "transformer_engine", "transformers"):
        try:
            versions[mod] = getattr(__import__(mod, fromlist=["__version__"]), "__version__", "?")
        except ImportError:
            versions[mod] = "absent"
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    line("environment", f"{where}; " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    ok = True
    if "parity" not in skip:
        ok &= check_parity(False, workdir, dtype, device, tol)
        ok &= check_parity(True, workdir, dtype, device, tol)
    if "step" not in skip:
        tokens = args.step_tokens or (16384 if device == "cuda" else 512)
        hidden, layers = (2048, 16) if device == "cuda" else (256, 2)
        check_step(workdir, dtype, device, tokens, hidden, layers)
    if "sync" not in skip:
        ok &= check_nccl_sync(workdir, device)
    if "grpo" not in skip:
        check_grpo_vllm(workdir, device, args.grpo_steps)
    line("result", "OK" if ok else "FAIL: a parity or sync check failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
