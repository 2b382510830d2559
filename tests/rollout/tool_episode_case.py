"""The learner's side of the 3-turn tool episode through vLLM (tests/rollout/test_vllm.py): a
Megatron learner (fp32, one process, TP 1) warmed up on one scripted tool episode, so that a tiny
random model calls the tool by itself under greedy decoding."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from megarl.batch import PackedBatch


class _NLL:
    """Token-sum NLL over the loss mask / the batch's token count; reports the worst scripted token."""

    def __call__(self, logits, batch, ctx):
        from megarl.objectives.api import LossOutput
        from megarl.ops.vocab_parallel import vocab_parallel_logprobs_entropy

        logp, _ = vocab_parallel_logprobs_entropy(logits, batch.tokens, ctx.tp_group, ctx.chunk_tokens)
        on = batch.loss_mask > 0
        loss = -(logp * batch.loss_mask.to(logp)).sum() / ctx.normalisers.num_tokens
        return LossOutput(loss=loss, metrics={"min_logprob": logp.detach()[on].min()})


def warm_up(
    hf_dir: str | Path,
    out_dir: str | Path,
    tokens: list[int],
    loss_mask: list[float],
    prompt_len: int,
    lr: float = 1e-2,
    min_prob: float = 0.6,
    max_steps: int = 150,
):
    """SFT of ``hf_dir`` on one scripted sequence until every scripted token has probability above
    ``min_prob`` (so greedy decoding reproduces the script with a margin no kernel difference
    flips), at most ``max_steps`` steps; the weights go to ``out_dir`` as an HF checkpoint.
    Returns the learner (holding exactly the exported weights) and ``{"steps", "min_logprob"}``."""
    from megarl.convert.hf_megatron import save_hf_checkpoint
    from megarl.learner.factory import build_learner
    from megarl.learner.model import load_hf_config
    from megarl.learner.optim_config import OptimConfig
    from megarl.learner.parallel import ParallelLayout, initialize_parallel

    groups = initialize_parallel(ParallelLayout())
    ln = build_learner(dict(load_hf_config(str(hf_dir))), groups, OptimConfig(), lr=lr)
    ln.load_hf(str(hf_dir))
    batch = PackedBatch(
        tokens=torch.tensor(tokens, dtype=torch.long),
        cu_seqlens=torch.tensor([0, len(tokens)]),
        prompt_lens=torch.tensor([prompt_len]),
        loss_mask=torch.tensor(loss_mask, dtype=torch.float32),
        group_ids=torch.tensor([0]),
        advantages=torch.zeros(len(tokens)),
    ).validate()
    on = batch.loss_mask > 0
    steps = 0
    while True:
        # checked on the weights that are exported: a step's own "before the update" figure can
        # pass while its update throws one token back below the margin
        worst = float(ln.compute_logprobs(batch)[0][on].min())
        if worst > math.log(min_prob) or steps == max_steps:
            break
        ln.train_step(batch, _NLL())
        steps += 1
    save_hf_checkpoint(ln.model, groups, str(out_dir), hf_config=ln.hf_config)
    return ln, {"steps": steps, "min_logprob": worst}
