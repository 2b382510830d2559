"""Thin adapters between the trainer and the learner / rollout packages.

- ``build_learner``: a megarl ``Learner`` from the run config (random init or a HF checkpoint).
- ``SFTObjective``: token-mean negative log-likelihood, for the supervised warm-up.
- ``hf_model_from_config``: the transformers model the embedded engine generates with.
- ``export_state``: the learner's weights as HF-named tensors (collective), for the in-memory
  weight sync of the embedded engine; server engines get them through ``save_hf_checkpoint``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megarl.batch import PackedBatch
from megarl.objectives.api import LossContext, LossOutput


def build_learner(cfg, hf_config: dict, groups, lr: Optional[float] = None, trainable: bool = True):
    """A ``Learner`` for ``hf_config`` under ``groups`` with the run's optimizer settings
    (``lr`` overrides the optimizer's LR, used by the warm-up; ``trainable=False``: a forward-only
    learner without optimizer state, for the KL reference)."""
    import dataclasses

    from megarl.learner.learner import Learner, LearnerConfig

    optim = cfg.optimizer  # the config's optimizer section is the learner's OptimConfig
    if lr is not None:  # the warm-up: its own constant LR
        optim = dataclasses.replace(optim, lr=lr, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=0,
                                    lr_decay_style="constant")
    dtype = torch.bfloat16 if cfg.model.params_dtype == "bfloat16" else torch.float32
    return Learner(LearnerConfig(hf_config=hf_config, optim=optim, params_dtype=dtype, seed=cfg.model.seed,
                                 trainable=trainable), groups)


class SFTObjective:
    """``-sum(mask * logp) / N_tok`` (globally normalised token mean). logits: [T, V/tp]."""

    def __call__(self, logits: torch.Tensor, batch: PackedBatch, ctx: LossContext) -> LossOutput:
        from megarl.ops.vocab_parallel import vocab_parallel_logprobs_entropy

        logp, ent = vocab_parallel_logprobs_entropy(logits, batch.tokens, ctx.tp_group, ctx.chunk_tokens,
                                                    with_entropy=True)
        mask = batch.loss_mask.to(logp.dtype)
        n = max(ctx.normalisers.num_tokens, 1.0)
        loss = -(logp * mask).sum() / n
        return LossOutput(loss=loss, metrics={"nll": loss.detach(),
                                              "entropy": ((ent.detach() * mask).sum() / n)})


def hf_model_from_config(hf_config: dict) -> torch.nn.Module:
    """A transformers causal LM with the architecture of ``hf_config`` (weights come from the learner)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {k: v for k, v in hf_config.items() if k not in ("model_type", "architectures", "transformers_version")}
    config = AutoConfig.for_model(hf_config["model_type"], **kw)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def export_state(learner) -> dict[str, torch.Tensor]:
    """All HF-named tensors of the learner's model on every rank (collective over the world)."""
    from megarl.convert.hf_megatron import iter_hf_tensors

    return {name: t.float() for name, t in iter_hf_tensors(learner.model, learner.groups)}


def weights_equal(model: torch.nn.Module, state: dict[str, Any]) -> bool:
    """Whether every tensor of ``state`` equals the model's (a weight-sync check)."""
    own = model.state_dict()
    return all(k in own and torch.equal(own[k].float(), v.float()) for k, v in state.items())
