"""A trained teacher for distillation tests: a short supervised fit on the task's answers.

A random-weight teacher proves plumbing only (its logprobs carry no knowledge of the task).
``fit_teacher`` trains a model of any architecture sharing the policy's vocabulary (the policy's
own, or a Mixture-of-Experts one for a dense student) with the warm-up's SFT objective on the
training set's answers under the run's parallel layout, and writes it as an HF checkpoint. On the
tiny CPU models it takes seconds; its held-out answer NLL is returned so a test can check that the
teacher knows the task better than the student it teaches.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch


def answer_nll(learner: Any, tok: Any, rows: list) -> float:
    """Mean per-token NLL of ``rows``' answers (+ EOS) under ``learner`` (collective)."""
    from megarl.trainer.warmup import sft_batch

    batch = sft_batch(tok, rows)
    lp, _ = learner.compute_logprobs(batch, 1)
    m = batch.loss_mask.bool()
    return float(-lp[m].mean())


def fit_teacher(
    run: Any,
    out_dir: str | Path,
    hf_config: dict | None = None,
    steps: int = 40,
    lr: float = 2e-3,
    batch_size: int = 32,
    seed: int = 99,
) -> dict[str, float]:
    """Train a teacher on ``run.train_ds``'s answers for ``steps`` SFT steps and write it to
    ``out_dir`` (HF safetensors + config); collective over the run's world.

    ``run``: a trainer ``Run`` after its process groups and datasets exist (``make_learner``,
    ``groups``, ``tok``, ``train_ds``, ``eval_ds``, ``dp_share``, ``dp_group``); ``hf_config``:
    the teacher's architecture (default: the policy's; its ``vocab_size`` must be the policy's).
    Returns ``eval_nll`` (held-out answers), ``train_nll`` (last step) and ``seconds``.
    """
    from megarl.convert.hf_megatron import save_hf_checkpoint
    from megarl.data.dataset import PromptSampler
    from megarl.objectives.api import GlobalNormalisers
    from megarl.trainer.warmup import SFTObjective, sft_batch

    hf = dict(hf_config or run.hf)
    if int(hf.get("vocab_size", -1)) != int(run.hf["vocab_size"]):
        raise ValueError(
            f"fit_teacher: hf_config vocab_size {hf.get('vocab_size')} differs from the policy's "
            f"{run.hf['vocab_size']}"
        )
    t0 = time.time()
    torch.manual_seed(seed)
    ln = run.make_learner(hf, lr=lr)
    sampler = PromptSampler(len(run.train_ds), seed)
    obj = SFTObjective()
    m: dict = {}
    for _ in range(steps):
        rows = [run.train_ds.rows[i] for i in sampler.next_indices(batch_size)]
        share = run.dp_share(sft_batch(run.tok, rows))
        m = ln.train_step(share, obj, 1, GlobalNormalisers.from_batch(share, run.dp_group()))
    eval_nll = answer_nll(ln, run.tok, list(run.eval_ds.rows))
    save_hf_checkpoint(ln.model, run.groups, Path(out_dir), hf_config=hf)
    del ln
    return {"eval_nll": eval_nll, "train_nll": float(m.get("nll", float("nan"))), "seconds": time.time() - t0}
