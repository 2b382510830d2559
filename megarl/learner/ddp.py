"""megatron-core's ``DistributedDataParallel`` with gradient hooks that do not keep it alive.

megatron DDP registers one hook per parameter on the parameter's gradient accumulator (a C++
autograd node) and keeps those nodes in ``self.grad_accs``. Each hook is a closure over the DDP
object, so DDP -> grad_accs -> node -> hook -> DDP is a reference cycle that passes through C++,
where Python's garbage collector cannot see it: a dropped learner (model, gradient buffers,
optimizer state) was never freed. Here each hook holds the DDP object through a weak reference, so
dropping the last strong reference frees the learner, its nodes and their hooks.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel


class WeakHookDDP(DistributedDataParallel):
    """``DistributedDataParallel`` whose backward hooks reference it weakly (see the module docstring)."""

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        """megatron's per-parameter backward hook, run through a weak reference to this object."""
        ddp_ref = weakref.ref(self)
        make_hook = DistributedDataParallel._make_backward_post_hook

        def hook(*args: Any) -> None:
            ddp = ddp_ref()
            if ddp is not None:  # a learner being freed has no backward pass left to serve
                make_hook(ddp, param)(*args)

        return hook
