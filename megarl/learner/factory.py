"""Learners from plain settings, and their weights as HF-named tensors.

- ``build_learner``: a ``Learner`` for a HF config under a parallel layout's groups, with an
  optimizer config (or forward-only, for a frozen reference or a teacher).
- ``export_state``: the learner's weights as HF-named tensors on every rank (collective), for the
  in-memory weight sync of the embedded engine and for step dumps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megarl.learner.optim_config import OptimConfig


def build_learner(
    hf_config: dict,
    groups: Any,
    optim: OptimConfig,
    params_dtype: str = "float32",
    seed: int = 1234,
    trainable: bool = True,
    lr: float | None = None,
    fused_output: str = "auto",
    heads: tuple[str, ...] = (),
):
    """A ``Learner`` for ``hf_config`` under ``groups``. ``lr`` overrides the optimizer's LR with a
    constant one (a supervised warm-up); ``trainable=False``: forward-only, no optimizer state;
    ``fused_output``: auto | on | off (megarl/learner/fused_output.py);
    ``heads``: extra scalar output heads on its trunk (megarl/learner/heads.py)."""
    from megarl.learner.learner import Learner, LearnerConfig

    if lr is not None:
        optim = dataclasses.replace(
            optim, lr=lr, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=0, lr_decay_style="constant"
        )
    dtype = torch.bfloat16 if params_dtype == "bfloat16" else torch.float32
    return Learner(
        LearnerConfig(
            hf_config=hf_config,
            optim=optim,
            params_dtype=dtype,
            seed=seed,
            trainable=trainable,
            heads=heads,
            fused_output=fused_output,
        ),
        groups,
    )


def export_state(learner) -> dict[str, torch.Tensor]:
    """All HF-named tensors of the learner's model on every rank (collective over the world)."""
    from megarl.convert.hf_megatron import iter_hf_tensors

    return {name: t.float() for name, t in iter_hf_tensors(learner.model, learner.groups)}
