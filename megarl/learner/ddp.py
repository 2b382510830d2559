"""megatron-core's ``DistributedDataParallel`` with gradient hooks that do not keep it alive, and
without collectives over one process.

megatron DDP registers one hook per parameter on the parameter's gradient accumulator (a C++
autograd node) and keeps those nodes in ``self.grad_accs``. Each hook is a closure over the DDP
object, so DDP -> grad_accs -> node -> hook -> DDP is a reference cycle that passes through C++,
where Python's garbage collector cannot see it: a dropped learner (model, gradient buffers,
optimizer state) was never freed. Here each hook holds the DDP object through a weak reference, so
dropping the last strong reference frees the learner, its nodes and their hooks.

A bucket group whose reduction spans one process (its data-parallel / distributed-optimizer group
has size 1, the group's actual size: a single-GPU or single-process run) skips the gradient
reduce-scatter and the parameter all-gather: over one rank they write each buffer onto itself. The
gradient scaling and megatron's gradient checks still run, so the numbers are those of the
collectives; larger groups keep megatron's own methods.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel


class WeakHookDDP(DistributedDataParallel):
    """``DistributedDataParallel`` whose backward hooks reference it weakly and whose one-process
    bucket groups run no collective (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        for group in self.bucket_groups + self.expert_parallel_bucket_groups:
            if reduces_alone(group):
                group.start_grad_sync = partial(_grad_sync_alone, group)
                group.start_param_sync = partial(_param_sync_alone, group)

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        """megatron's per-parameter backward hook, run through a weak reference to this object."""
        ddp_ref = weakref.ref(self)
        make_hook = DistributedDataParallel._make_backward_post_hook

        def hook(*args: Any) -> None:
            ddp = ddp_ref()
            if ddp is not None:  # a learner being freed has no backward pass left to serve
                make_hook(ddp, param)(*args)

        return hook


def reduces_alone(group: Any) -> bool:
    """Whether megatron's bucket group ``group`` reduces gradients and gathers parameters over a
    process group of size 1, with synchronous collectives and one distributed-optimizer instance."""
    cfg = group.ddp_config
    if (
        cfg.overlap_grad_reduce
        or cfg.overlap_param_gather
        or cfg.num_distributed_optimizer_instances != 1
        or getattr(cfg, "reduce_scatter_with_fp32_accumulation", False)
    ):
        return False
    pg = (
        group.intra_distributed_optimizer_instance_group
        if cfg.use_distributed_optimizer
        else group.data_parallel_group
    )
    return pg is not None and pg.size() == 1


def _grad_sync_alone(group: Any, force_all_reduce: bool | None = False) -> None:
    """megatron's ``start_grad_sync`` for a one-process group: one rank's sum is its gradients."""
    cfg = group.ddp_config
    if cfg.check_for_nan_in_grad or cfg.check_for_large_grads:
        group.check_grads(
            check_for_nan_or_inf=cfg.check_for_nan_in_grad, check_for_large=cfg.check_for_large_grads
        )
    for bucket in group.buckets:
        if bucket.gradient_scaling_factor != 1.0:
            bucket.grad_data *= bucket.gradient_scaling_factor
    group.grad_reduce_handle = None


def _param_sync_alone(group: Any, force_sync: bool = False) -> None:
    """megatron's ``start_param_sync`` for a one-process group: the one shard is the whole buffer."""
    group.param_gather_handle = None
    group.param_gather_dispatched = True
