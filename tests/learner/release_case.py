"""Builds, uses and drops a tiny trainable learner again and again in one process (world of one,
CPU); prints one JSON line: per round, whether the dropped learners are still alive (weak
references) and the process's resident memory after ``gc.collect``.

Run by tests/learner/test_learner_release.py: ``python tests/learner/release_case.py ROUNDS``.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import weakref

import torch

from megarl.batch import PackedBatch
from megarl.learner.factory import build_learner
from megarl.learner.optim_config import OptimConfig
from megarl.learner.parallel import ParallelLayout, initialize_parallel
from megarl.objectives.api import GlobalNormalisers, LossContext, LossOutput
from megarl.ops.vocab_parallel import vocab_parallel_logprobs_entropy

VOCAB = 512
HF = dict(
    model_type="qwen3",
    vocab_size=VOCAB,
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=96,
    tie_word_embeddings=False,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def rss_mb() -> float:
    """This process's resident set size in MiB, after glibc has handed its free heap back to the
    system (else freed memory that malloc keeps in its arenas reads as growth)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figure includes allocator slack
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def batch() -> PackedBatch:
    g = torch.Generator().manual_seed(0)
    lens = (9, 7)
    cu = torch.tensor([0, 9, 16])
    mask = torch.ones(sum(lens))
    mask[[0, 9]] = 0.0
    return PackedBatch(
        tokens=torch.randint(0, VOCAB, (sum(lens),), generator=g),
        cu_seqlens=cu,
        prompt_lens=torch.tensor([1, 1]),
        loss_mask=mask,
        group_ids=torch.tensor([0, 0]),
        advantages=torch.randn(sum(lens), generator=g),
    ).validate()


def objective(logits: torch.Tensor, b: PackedBatch, ctx: LossContext) -> LossOutput:
    lp, _ = vocab_parallel_logprobs_entropy(logits, b.tokens, ctx.tp_group, ctx.chunk_tokens)
    return LossOutput(loss=-(lp * b.advantages * b.loss_mask).sum() / ctx.normalisers.num_tokens)


def main(rounds: int) -> None:
    groups = initialize_parallel(ParallelLayout())
    b = batch()
    norms = GlobalNormalisers.from_batch(b, None, 8.0)
    refs, alive, rss = [], [], []
    for _ in range(rounds):
        ln = build_learner(HF, groups, OptimConfig(lr=1e-3))
        ln.train_step(b, objective, 1, norms)  # gradients, optimizer state, hooks all used
        ln.compute_logprobs(b)
        refs.append(weakref.ref(ln))
        del ln
        gc.collect()
        alive.append(sum(r() is not None for r in refs))
        rss.append(round(rss_mb(), 1))
    print(json.dumps({"alive": alive, "rss_mb": rss}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
