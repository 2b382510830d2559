"""The pruned proxy through megarl's converter under expert parallelism (run by torchrun).

``torchrun --nproc-per-node 2 tests/proxy/dist_proxy.py --workdir DIR``: rank 0 builds a tiny
Qwen3-MoE (8 experts, top-2) and prunes it to 4 experts for EP=2 with ``megarl proxy prune``; every
rank loads the proxy into the Megatron learner (EP=2: 2 experts per rank), compares per-token
logprobs with transformers on the same proxy directory, and exports the weights back to HF names
(bit-exact against the proxy's safetensors). Rank 0 prints one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megarl.batch import PackedBatch
from megarl.convert.hf_megatron import iter_hf_tensors
from megarl.learner.learner import Learner, LearnerConfig
from megarl.learner.parallel import ParallelLayout, init_distributed, initialize_parallel

TOL = 1e-4  # as the converter's own parity tests (fp32: measured ~2e-7)


def packed_batch(vocab: int, lens=(9, 14, 6, 11), seed: int = 5) -> PackedBatch:
    """Random token sequences, packed (same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = torch.zeros(len(lens) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    mask = torch.ones(T)
    mask[cu[:-1]] = 0.0  # the first token of a sequence has no logprob
    return PackedBatch(
        tokens=torch.randint(0, vocab, (T,), generator=g),
        cu_seqlens=cu,
        prompt_lens=torch.ones(len(lens), dtype=torch.long),
        loss_mask=mask,
        group_ids=torch.arange(len(lens)),
        advantages=torch.zeros(T),
    ).validate()


def hf_logprobs(model_dir: str, batch: PackedBatch) -> torch.Tensor:
    """Aligned per-token logprobs [T] from transformers (first token of each sequence: 0)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = torch.zeros(batch.num_tokens)
    cu = batch.cu_seqlens.tolist()
    with torch.no_grad():
        for a, b in itertools.pairwise(cu):
            lp = torch.log_softmax(hf(batch.tokens[None, a:b]).logits[0], -1)
            out[a + 1 : b] = lp[:-1].gather(-1, batch.tokens[a + 1 : b, None])[:, 0]
    return out


def run(workdir: str) -> dict:
    from safetensors import safe_open

    from megarl.proxy.prune import prune_moe_checkpoint
    from tests.proxy.helpers import CALIB_TEXTS, build_tiny_moe

    src, proxy = os.path.join(workdir, "orig"), os.path.join(workdir, "proxy")
    if dist.get_rank() == 0:
        build_tiny_moe(src, "qwen3_moe", num_experts=8, top_k=2, layers=2)
        prune_moe_checkpoint(src, proxy, 4, CALIB_TEXTS, ep_size=2)
    dist.barrier()
    groups = initialize_parallel(ParallelLayout(ep=2))
    ln = Learner(LearnerConfig(hf_config=proxy, trainable=False), groups)
    ln.load_hf(proxy)
    local_experts = sum(
        1 for n, _ in ln.model.named_parameters() if "local_experts" in n and "linear_fc1" in n
    )
    batch = packed_batch(1024)
    lp, _ = ln.compute_logprobs(batch)
    ref = hf_logprobs(proxy, batch)
    diff = float((lp - ref).abs().max())
    exported = dict(iter_hf_tensors(ln.model, ln.groups))
    mismatched = []
    with safe_open(os.path.join(proxy, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        mismatched = [k for k in keys if k not in exported or not torch.equal(f.get_tensor(k), exported[k])]
    extra = sorted(set(exported) - keys)
    t = torch.tensor([diff, len(mismatched) + len(extra)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {
        "logprob_max_abs_diff": float(t[0]),
        "export_mismatches": int(t[1]),
        "num_tensors": len(exported),
        "local_experts_per_layer": local_experts // 2,
        "mismatched": mismatched[:5],
        "extra": extra[:5],
        "ok": float(t[0]) <= TOL and int(t[1]) == 0 and local_experts // 2 == 2,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    init_distributed()
    try:
        res = run(args.workdir)
    except Exception as e:
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(res), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
