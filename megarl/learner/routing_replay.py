"""MoE routing replay (R3): record the experts each token was routed to, replay them in training.

Built on megatron-core's per-router ``RouterReplay`` (``moe_enable_routing_replay``), but addressed
through the model's own routers in layer order, never through megatron's process-wide instance
list (which also holds routers of models built earlier in the process).

Layout of recorded routes: ``routed_experts: [T, n_moe_layers, topk]`` int64, aligned with
``batch.tokens`` (megarl/batch.py), MoE layers in model order. Under sequence parallelism each TP
rank's routers see a contiguous ``T_pad / tp`` slice of the (padded) tokens; under PP each stage
holds some of the layers. ``collect`` gathers both so every rank gets the full tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.learner.parallel import ParallelGroups


class RoutingReplayError(ValueError):
    """Routing replay was asked for but the batch or model cannot provide it."""


def moe_routers(model: torch.nn.Module) -> list[tuple[int, object]]:
    """(index among all MoE layers of the model, RouterReplay) for this stage's MoE layers, in order."""
    spec = model.megarl_spec
    out = []
    for layer in model.decoder.layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is None:
            continue
        if router.router_replay is None:
            raise RoutingReplayError(
                "the model was built without moe_enable_routing_replay "
                "(LearnerConfig.moe_routing_replay=False)"
            )
        out.append((spec.moe_layers.index(layer.layer_number - 1), router.router_replay))
    return out


def set_action(model: torch.nn.Module, action: str | None) -> None:
    """'record', 'replay' or None (normal routing) on every MoE router of this stage."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    act = {"record": RouterReplayAction.RECORD, "replay": RouterReplayAction.REPLAY_FORWARD, None: None}[
        action
    ]
    for _, rr in moe_routers(model):
        rr.clear_indices()
        if act is None:
            rr.clear_router_replay_action()
        else:
            rr.set_router_replay_action(act)


def local_token_slice(num_tokens_padded: int, groups: ParallelGroups) -> slice:
    """The tokens this rank's routers see (all of them, or its sequence-parallel chunk)."""
    if not groups.layout.sequence_parallel:
        return slice(0, num_tokens_padded)
    n = num_tokens_padded // groups.layout.tp
    return slice(groups.tp_rank * n, (groups.tp_rank + 1) * n)


def set_replay_targets(
    model: torch.nn.Module, routed_experts: torch.Tensor, num_tokens_padded: int, groups: ParallelGroups
) -> None:
    """Before a micro-batch forward: give each local router its recorded experts.

    routed_experts: [T, n_moe_layers, topk] of the micro-batch; padding tokens (T..T_pad) get
    experts 0..topk-1 (they are excluded from the loss and from routing statistics).
    """
    T, _, k = routed_experts.shape
    sl = local_token_slice(num_tokens_padded, groups)
    for moe_idx, rr in moe_routers(model):
        idx = routed_experts[:, moe_idx, :].long()
        if num_tokens_padded > T:
            pad = torch.arange(k).expand(num_tokens_padded - T, k)
            idx = torch.cat([idx, pad])
        rr.clear_indices()
        rr.set_target_indices(idx[sl].to(groups.device))


def collect_local(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """After a micro-batch forward in record mode: {moe layer index: [local tokens, topk]}."""
    out = {}
    for moe_idx, rr in moe_routers(model):
        idx = rr.get_recorded_indices()
        if idx is None:
            raise RoutingReplayError(f"MoE layer {moe_idx} recorded no routing")
        out[moe_idx] = idx.detach().long().cpu()
    return out


def assemble(
    per_micro: list[dict[int, torch.Tensor]],
    micro_tokens: list[int],
    num_moe_layers: int,
    topk: int,
    groups: ParallelGroups,
) -> torch.Tensor:
    """Per-micro-batch local records -> the full ``[T, n_moe_layers, topk]`` on every rank (collective)."""
    local = {}
    for mb, T in zip(per_micro, micro_tokens):
        for moe_idx, idx in mb.items():
            if groups.layout.sequence_parallel and groups.layout.tp > 1:
                parts = [torch.empty_like(idx) for _ in range(groups.layout.tp)]
                dist.all_gather(parts, idx.to(groups.device).contiguous(), group=groups.tp)
                idx = torch.cat([p.cpu() for p in parts])
            local.setdefault(moe_idx, []).append(idx[:T])
    local = {k: torch.cat(v) for k, v in local.items()}
    if groups.layout.pp > 1:
        everything: list = [None] * groups.layout.pp
        dist.all_gather_object(everything, local, group=groups.pp)
        for d in everything:
            local.update(d)
    missing = [i for i in range(num_moe_layers) if i not in local]
    if missing:
        raise RoutingReplayError(f"no routing recorded for MoE layers {missing}")
    return torch.stack([local[i] for i in range(num_moe_layers)], dim=1)
