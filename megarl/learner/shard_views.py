"""The distributed optimizer's fp32 shard views marked as grad-retaining.

For fp32 parameters megatron's distributed optimizer steps on views of the parameters
(``model_param.view(-1)[start:end]``): non-leaf tensors whose ``.grad`` it assigns before each step
and reads in ``zero_grad()``. Reading ``.grad`` of a non-leaf tensor while it is unset makes autograd
warn ("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"), once per run
and again after every resume. A view marked ``retain_grad()`` is read without that warning; its
gradient stays what megatron assigns, since the view is not part of the forward graph and autograd
never writes it.
"""

from __future__ import annotations

from typing import Any


def retain_grad_on_shard_views(optimizer: Any) -> int:
    """Mark every non-leaf parameter view in ``optimizer``'s shard groups (chained or single
    megatron optimizers); returns how many were marked."""
    marked = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for groups in (getattr(opt, "shard_fp32_groups", []), getattr(opt, "shard_float16_groups", [])):
            for group in groups:
                for p in group:
                    if p.requires_grad and not p.is_leaf and not p.retains_grad:
                        p.retain_grad()
                        marked += 1
    return marked
