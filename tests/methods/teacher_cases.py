"""Shared pieces of the teacher-source tests: a packed batch of the student's token ids and the
Megatron teacher's logprobs of it (the reference an engine-served teacher must match)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megarl.batch import PackedBatch, from_sequences
from megarl.testing.tiny_qwen3 import TINY_QWEN3_HF


def student_batch(
    vocab: int, prompt: list[int], lens: tuple[int, ...] = (9, 17, 30), seed: int = 0
) -> PackedBatch:
    """``len(lens)`` sequences: ``prompt`` followed by that many random response tokens."""
    g = torch.Generator().manual_seed(seed)
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    return from_sequences([list(prompt)] * len(lens), responses, list(range(len(lens))))


def megatron_teacher_logprobs(hf_dir: str | Path, batch: PackedBatch, micro_batches: int = 2) -> torch.Tensor:
    """``teacher_logprobs`` [T] from the forward-only Megatron teacher (fp32, one process, TP 1)."""
    from megarl.learner.factory import build_learner
    from megarl.learner.model import load_hf_config
    from megarl.learner.optim_config import OptimConfig
    from megarl.learner.parallel import ParallelLayout, init_distributed, initialize_parallel
    from megarl.plugin.core_inputs import FrozenPass

    init_distributed()
    groups = initialize_parallel(ParallelLayout())
    ln = build_learner(dict(load_hf_config(str(hf_dir))), groups, OptimConfig(), trainable=False)
    ln.load_hf(str(hf_dir))
    b = batch.select(list(range(batch.num_seqs)))
    FrozenPass(ln, "teacher_logprobs").fill(b, micro_batches)
    return b.teacher_logprobs


def tiny_learner_setup(vocab_size: int) -> tuple[dict, Any]:
    """A one-layer Qwen3 config with ``vocab_size`` tokens for Megatron learners, and this process's
    single-rank parallel groups (the default process group started once)."""
    from megarl.learner.parallel import ParallelLayout, init_distributed, initialize_parallel

    init_distributed()
    return dict(TINY_QWEN3_HF, vocab_size=vocab_size), initialize_parallel(ParallelLayout())
