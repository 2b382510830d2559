"""Fixtures for tests/learner/test_convert_cli.py: tiny random Qwen3 / Qwen3-MoE HF directories,
and steps that run inside one process group (``python convert_helpers.py STEP ...``, or under
torchrun), so several conversions share one start-up.

Steps:
- ``run-ckpt HF_DIR RUN_DIR REF_DIR OUT_DIR``: one process. Train a learner one step from HF_DIR,
  save a real run checkpoint (megarl.trainer.run_checkpoint.save: learner with Adam state +
  trainer.json) and an init_policy/ copy of HF_DIR, export the trained weights to REF_DIR, then
  run ``megarl convert megatron-to-hf`` on the step directory into OUT_DIR, and again on the run
  directory with --overwrite. Prints ``RESULT {json}``.
- ``convert ARGS... [-- ARGS...]``: run ``megarl convert`` once per ``--``-separated argument list
  (in one process group); prints ``RESULT {json}`` with the exit codes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.learner.dist_cases import VOCAB, tiny_hf_config  # noqa: E402


def make_tiny_hf(out: Path, moe: bool, seed: int = 0) -> Path:
    """A random-weight fp32 Qwen3 (or Qwen3-MoE) saved with ``save_pretrained``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = (
        Qwen3MoeForCausalLM(Qwen3MoeConfig(**tiny_hf_config(True)))
        if moe
        else Qwen3ForCausalLM(Qwen3Config(**tiny_hf_config(False)))
    )
    model.float().save_pretrained(out)
    return Path(out)


def read_hf_tensors(d: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors directory."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


class _NLL:
    """Token-mean negative log-likelihood (one training step for the run checkpoint)."""

    def __call__(self, logits, batch, ctx):
        from megarl.objectives.api import LossOutput
        from megarl.ops.vocab_parallel import vocab_parallel_logprobs_entropy

        logp, _ = vocab_parallel_logprobs_entropy(logits, batch.tokens, ctx.tp_group, ctx.chunk_tokens)
        loss = -(logp * batch.loss_mask.to(logp)).sum() / ctx.normalisers.num_tokens
        return LossOutput(loss=loss, metrics={"nll": loss.detach()})


def _run_ckpt(hf_dir: str, run_dir: str, ref_dir: str, out_dir: str) -> dict:
    from megarl.convert.convert_cli import main as convert
    from megarl.convert.hf_megatron import save_hf_checkpoint
    from megarl.learner.learner import Learner, LearnerConfig, OptimConfig
    from megarl.learner.parallel import ParallelLayout, initialize_parallel
    from megarl.trainer import run_checkpoint

    groups = initialize_parallel(ParallelLayout())
    ln = Learner(LearnerConfig(hf_config=hf_dir, optim=OptimConfig(lr=1e-2)), groups)
    ln.load_hf(hf_dir)
    ln.train_step(_tiny_batch(), _NLL())
    shutil.copytree(hf_dir, Path(run_dir) / "init_policy")
    step_dir = run_checkpoint.save(run_dir, 1, ln, {"sampler": {}}, keep_last=2)
    save_hf_checkpoint(ln.model, groups, ref_dir, hf_config=ln.hf_config)
    rc_step = convert(["megatron-to-hf", "--ckpt", str(step_dir), "--out", out_dir])
    rc_refuse = convert(["megatron-to-hf", "--ckpt", run_dir, "--out", out_dir])
    rc_run = convert(["megatron-to-hf", "--ckpt", run_dir, "--out", out_dir, "--overwrite"])
    return {"rc_step": rc_step, "rc_refuse": rc_refuse, "rc_run": rc_run, "step_dir": str(step_dir)}


def _model_only_load(hf_dir: str, ckpt_dir: str, out_a: str, out_b: str) -> dict:
    """hf-to-megatron, then one train step from (a) a learner that loads the converted checkpoint with
    load_checkpoint and (b) a learner that loads HF_DIR directly; both trained weights are exported.
    bf16 parameters, so that the optimizer keeps its own fp32 main copy (in fp32 it works on views of
    the parameters, and a stale copy could not show)."""
    from megarl.convert.convert_cli import main as convert
    from megarl.convert.hf_megatron import save_hf_checkpoint
    from megarl.learner.dist_checkpoint import load_checkpoint
    from megarl.learner.learner import Learner, LearnerConfig, OptimConfig
    from megarl.learner.parallel import ParallelLayout, initialize_parallel

    rc = convert(["hf-to-megatron", "--hf", hf_dir, "--out", ckpt_dir])
    groups = initialize_parallel(ParallelLayout())
    metas = []
    for out, load in ((out_a, "ckpt"), (out_b, "hf")):
        torch.manual_seed(1 if load == "ckpt" else 2)  # different random init: the load must replace it
        cfg = LearnerConfig(hf_config=hf_dir, optim=OptimConfig(lr=1e-2), params_dtype=torch.bfloat16)
        ln = Learner(cfg, groups)
        if load == "ckpt":
            metas.append(load_checkpoint(ln, ckpt_dir))
        else:
            ln.load_hf(hf_dir)
        ln.train_step(_tiny_batch(), _NLL())
        save_hf_checkpoint(ln.model, groups, out, hf_config=ln.hf_config)
    return {"rc": rc, "optimizer_restored": metas[0]["optimizer_restored"], "step": metas[0]["step"]}


def _tiny_batch():
    from megarl.batch import PackedBatch

    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([7, 9])
    cu = torch.zeros(3, dtype=torch.long)
    cu[1:] = torch.cumsum(lens, 0)
    mask = torch.ones(16)
    mask[cu[:-1]] = 0.0  # the first token of a sequence has no logprob
    return PackedBatch(
        tokens=torch.randint(0, VOCAB, (16,), generator=g),
        cu_seqlens=cu,
        prompt_lens=torch.tensor([1, 1]),
        loss_mask=mask,
        group_ids=torch.tensor([0, 1]),
        advantages=torch.zeros(16),
    ).validate()


def _convert_many(argv: list[str]) -> dict:
    from megarl.convert.convert_cli import main as convert

    lists, cur = [], []
    for a in argv:
        if a == "--":
            lists.append(cur)
            cur = []
        else:
            cur.append(a)
    lists.append(cur)
    return {"rcs": [convert(a) for a in lists]}


if __name__ == "__main__":
    step, rest = sys.argv[1], sys.argv[2:]
    if step == "run-ckpt":
        res = _run_ckpt(*rest)
    elif step == "model-only-load":
        res = _model_only_load(*rest)
    else:
        res = _convert_many(rest)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(res), flush=True)
