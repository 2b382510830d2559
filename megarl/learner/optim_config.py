"""The optimizer settings of a learner: plain data, no megatron import (the trainer's config loads it
as its ``optimizer`` section without pulling in megatron)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class OptimConfig:
    """Adam + LR schedule (megatron's OptimizerParamScheduler) + clipping.
    ``lr_decay_steps`` 0 = constant after warm-up."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    use_distributed_optimizer: bool = True
