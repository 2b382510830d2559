"""The supervised warm-up before RL: a few SFT steps on the training answers, written as the initial
policy (HF safetensors), which is the RL start and the KL reference."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from megarl.batch import PackedBatch, from_sequences
from megarl.data.dataset import PromptRow, PromptSampler
from megarl.objectives.api import GlobalNormalisers, LossContext, LossOutput
from megarl.trainer.setup import log


class SFTObjective:
    """``-sum(mask * logp) / N_tok`` (globally normalised token mean). logits: [T, V/tp], or None
    with ``ctx.token_stats`` from the learner's fused output layer."""

    def accepts_token_stats(self) -> bool:
        """It reads only the per-token logprobs and entropies."""
        return True

    def __call__(self, logits, batch: PackedBatch, ctx: LossContext) -> LossOutput:
        from megarl.ops.vocab_parallel import vocab_parallel_logprobs_entropy

        if ctx.token_stats is not None:
            logp, ent = ctx.token_stats
        else:
            logp, ent = vocab_parallel_logprobs_entropy(
                logits, batch.tokens, ctx.tp_group, ctx.chunk_tokens, with_entropy=True
            )
        mask = batch.loss_mask.to(logp.dtype)
        n = max(ctx.normalisers.num_tokens, 1.0)
        loss = -(logp * mask).sum() / n
        return LossOutput(
            loss=loss, metrics={"nll": loss.detach(), "entropy": ((ent.detach() * mask).sum() / n)}
        )


def sft_batch(tok: Any, rows: list[PromptRow]) -> PackedBatch:
    """Prompt + answer + EOS per row, the answer in the loss."""
    P = [tok.encode(r.prompt) for r in rows]
    R = [tok.encode(r.answer, bos=False) + [tok.eos_id] for r in rows]
    return from_sequences(P, R, list(range(len(rows))))


def run_warmup(run: Any, init_dir: Path) -> None:
    """``warmup.sft_steps`` SFT steps from the configured start (random or ``model.hf_dir``); writes
    ``init_dir`` (collective)."""
    from megarl.convert.hf_megatron import save_hf_checkpoint

    cfg, w = run.cfg, run.cfg.warmup
    ln = run.make_learner(run.hf, lr=w.lr)
    if cfg.model.hf_dir is not None:
        ln.load_hf(cfg.model.hf_dir)
    sampler = PromptSampler(len(run.train_ds), cfg.schedule.seed + 7)
    obj = SFTObjective()
    t0 = time.time()
    for s in range(1, w.sft_steps + 1):
        rows = [run.train_ds.rows[i] for i in sampler.next_indices(w.batch_size)]
        share = run.dp_share(sft_batch(run.tok, rows))
        m = ln.train_step(share, obj, 1, GlobalNormalisers.from_batch(share, run.dp_group()))
        if s % 10 == 0 or s == w.sft_steps:
            log(f"warm-up {s:>3}/{w.sft_steps}  nll {m['nll']:.3f}  ({time.time() - t0:.1f}s)")
    save_hf_checkpoint(ln.model, run.groups, init_dir, hf_config=run.hf)
    del ln
