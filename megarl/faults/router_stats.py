"""Per-layer expert load of a megatron-core MoE model, counted by forward hooks on its routers.

megatron-core's ``TopKRouter.forward`` returns ``(probs [tokens, E], routing_map [tokens, E] bool)``;
a hook sums the routing map over tokens, which costs one reduction per layer and micro-batch.
Padding tokens (sequence-parallel padding) are counted too; they are a handful per micro-batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def moe_router_modules(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(global layer index, router module) of this pipeline stage's MoE layers, in order."""
    out = []
    for layer in getattr(getattr(model, "decoder", None), "layers", []):
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            out.append((int(layer.layer_number) - 1, router))
    return out


class RouterLoadCounter:
    """Counts tokens per expert per MoE layer while ``start()``-ed; ``collect()`` gathers them.

    ``moe_layers``: the model's global MoE layer indices (megarl ModelSpec.moe_layers), which fixes
    the row order of the counts on every rank and stage.
    """

    def __init__(self, model: torch.nn.Module, moe_layers: tuple[int, ...], num_experts: int):
        self.model, self.moe_layers, self.num_experts = model, tuple(moe_layers), num_experts
        self.counts = torch.zeros(len(self.moe_layers), max(num_experts, 1), dtype=torch.float64)
        self._handles: list = []

    def start(self) -> None:
        """Zero the counts and hook every local router."""
        self.stop()
        self.counts.zero_()
        for layer, router in moe_router_modules(self.model):
            row = self.moe_layers.index(layer)
            self._handles.append(router.register_forward_hook(self._hook(row)))

    def _hook(self, row: int):
        def hook(module, args, output):
            routing_map = output[1] if isinstance(output, tuple) else None
            if routing_map is not None:
                self.counts[row] += (
                    routing_map.detach().reshape(-1, routing_map.shape[-1]).sum(0).double().cpu()
                )

        return hook

    def stop(self) -> None:
        """Remove the hooks (counts are kept)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def collect(
        self, group: dist.ProcessGroup | None = None, device: torch.device | None = None
    ) -> torch.Tensor:
        """Counts ``[n_moe_layers, E]`` summed over ``group`` (collective when given): stages hold
        different layers and data-parallel replicas different tokens; tensor-parallel copies of the
        same tokens scale every expert of a layer alike, so load shares are unaffected."""
        c = self.counts.clone()
        if group is not None and dist.get_world_size(group) > 1:
            c = c.to(device or torch.device("cpu"))
            dist.all_reduce(c, group=group)
        return c.cpu()
