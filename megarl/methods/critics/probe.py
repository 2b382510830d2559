"""Read the policy's own activations during a forward-only pass: attention statistics and
hidden states of chosen layers, captured with module hooks, in the batch's token order.

The pass is the policy learner's ``compute_logprobs`` (every rank, collective); hooks see each
micro-batch's ``[1, T_pad]`` packed row in schedule order. Results are returned on every rank:
partial sums over tensor-parallel heads and pipeline stages are all-reduced.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from megarl.batch import PackedBatch


def decoder_layers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """This stage's transformer layers by global 0-based index."""
    return {int(layer.layer_number) - 1: layer for layer in model.decoder.layers}


def num_layers(model: torch.nn.Module) -> int:
    """The model's total number of transformer layers (every stage)."""
    return int(model.config.num_layers)


@contextmanager
def _hooks(pairs: list[tuple[torch.nn.Module, Any]]):
    """Forward hooks ``pairs`` on their modules for the duration of the block."""
    handles = [m.register_forward_hook(h) for m, h in pairs]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _all_reduce(t: torch.Tensor, group: Any, size: int, device: Any) -> torch.Tensor:
    """Sum over ``group`` (a no-op for a group of one), on the learner's device."""
    if size <= 1:
        return t
    d = t.to(device)
    dist.all_reduce(d, group=group)
    return d.cpu()


def run_probe(learner: Any, batch: PackedBatch, micro_batches: int, pairs: list[tuple[torch.nn.Module, Any]]):
    """One forward-only pass of ``learner`` over ``batch`` with the forward hooks ``pairs``."""
    learner.require_whole_rows("the activation probe")
    with _hooks(pairs):
        learner.compute_logprobs(batch, micro_batches)


def _scale(core: torch.nn.Module, head_dim: int) -> float:
    """The factor the core attention multiplies q·k by (megatron folds layer scaling into two)."""
    if getattr(core, "varlen_scale", None) is not None:
        return float(core.varlen_scale)
    scale = getattr(core, "softmax_scale", None)
    if scale is None:
        return head_dim**-0.5
    sms = getattr(core, "scale_mask_softmax", None)
    return float(scale) * float(getattr(sms, "scale", None) or 1.0)


def attention_rows_statistic(
    query: torch.Tensor, key: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, statistic: str
) -> torch.Tensor:
    """Per packed position [T]: the statistic of each query's causal attention row within its own
    sequence, summed over the heads. query [T(+pad), np, hn], key [T(+pad), ng, hn] (after RoPE);
    recomputed eagerly in float64 (fused kernels never materialise the probabilities)."""
    T = int(cu_seqlens[-1])
    q, k = query[:T].double(), key[:T].double()
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each key head serves np/ng query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    out = torch.zeros(T, dtype=torch.float64)
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        if b <= a:
            continue
        scores = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * scale
        causal = torch.ones(b - a, b - a, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), -1)
        if statistic == "max":
            s = probs.amax(-1)
        else:
            s = -(probs * torch.log(probs.clamp(min=1e-300))).sum(-1)
        out[a:b] = s.sum(0)
    return out


def attention_entropy_sums(
    learner: Any, batch: PackedBatch, micro_batches: int, layers: list[int] | None, statistic: str
) -> tuple[torch.Tensor, int]:
    """Per query position [T] (float64, every rank): the attention statistic summed over the heads
    and the selected layers, and the number of (head, layer) pairs summed.

    statistic ``entropy``: −Σ_j a_j log a_j of each query's attention row; ``max``: max_j a_j. A
    hook on each selected layer's core attention takes its query and key (after RoPE) and
    recomputes the rows eagerly (``attention_rows_statistic``).
    """
    learner.require_whole_rows("the attention probe")
    model, g = learner.model, learner.groups
    have = decoder_layers(model)
    total_layers = num_layers(model)
    wanted = list(range(total_layers)) if layers is None else list(layers)
    bad = [i for i in wanted if not 0 <= i < total_layers]
    if bad:
        raise ValueError(f"inputs.attention_concentration.layers: {bad} not in 0..{total_layers - 1}")
    mbs = batch.split(micro_batches)
    per_mb = [torch.zeros(mb.num_tokens, dtype=torch.float64) for mb in mbs]
    local = [i for i in wanted if i in have]
    calls = [0]
    heads = [0]

    def hook(core, args, kwargs, _out):
        query = args[0] if args else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]
        q = query.detach().reshape(query.shape[0], -1, query.shape[-2], query.shape[-1])[:, 0]
        kk = key.detach().reshape(key.shape[0], -1, key.shape[-2], key.shape[-1])[:, 0]
        idx = calls[0] // len(local)
        calls[0] += 1
        heads[0] = q.shape[1]
        mb = mbs[idx]
        per_mb[idx] += attention_rows_statistic(
            q.cpu(), kk.cpu(), mb.cu_seqlens, _scale(core, q.shape[-1]), statistic
        )

    handles = [
        have[i].self_attention.core_attention.register_forward_hook(hook, with_kwargs=True) for i in local
    ]
    try:
        learner.compute_logprobs(batch, micro_batches)
    finally:
        for h in handles:
            h.remove()
    out = torch.cat(per_mb) if per_mb else torch.zeros(0, dtype=torch.float64)
    out = _all_reduce(out, g.tp, g.layout.tp, g.device)
    out = _all_reduce(out, g.pp, g.layout.pp, g.device)
    count = torch.tensor([float(len(local) * heads[0])], dtype=torch.float64)
    count = _all_reduce(count, g.tp, g.layout.tp, g.device)
    count = _all_reduce(count, g.pp, g.layout.pp, g.device)
    return out, int(count.item())


def hidden_states(learner: Any, batch: PackedBatch, micro_batches: int, layer: int) -> torch.Tensor:
    """The policy's hidden state at every packed position [T, H] (float32, every rank): the output
    of transformer layer ``layer`` (0-based), or of the final norm for ``layer = -1``. Under
    sequence parallelism the shards are gathered; the stage holding the layer shares it."""
    model, g = learner.model, learner.groups
    total_layers = num_layers(model)
    if not -1 <= layer < total_layers:
        raise ValueError(f"inputs.values.layer={layer}: not -1 (the final norm) or in 0..{total_layers - 1}")
    if layer == -1:
        module = model.decoder.final_layernorm if g.is_last_stage else None
    else:
        module = decoder_layers(model).get(layer)
    chunks: list[torch.Tensor] = []

    def hook(_m, _args, out):
        h = (out[0] if isinstance(out, tuple) else out).detach()  # [s(/tp), b=1, H]
        if g.layout.sequence_parallel and g.layout.tp > 1:
            parts = [torch.empty_like(h) for _ in range(g.layout.tp)]
            dist.all_gather(parts, h.contiguous(), group=g.tp)
            h = torch.cat(parts, 0)
        chunks.append(h[:, 0].float().cpu())

    mbs = batch.split(micro_batches)
    run_probe(learner, batch, micro_batches, [(module, hook)] if module is not None else [])
    hidden = int(model.config.hidden_size)
    out = torch.zeros(batch.num_tokens, hidden, dtype=torch.float32)
    if chunks:
        out = torch.cat([c[: mb.num_tokens] for c, mb in zip(chunks, mbs)])
    return _all_reduce(out, g.pp, g.layout.pp, g.device)  # one stage holds the layer


def router_features(learner: Any, batch: PackedBatch, micro_batches: int) -> torch.Tensor:
    """The routing weights of every MoE layer at every packed position, [T, n_moe · E] (float32,
    every rank; layers in model order): each router's (top-k, normalised) probabilities over the
    E experts, 0 for the experts not chosen. Gathered under sequence parallelism; each pipeline
    stage fills its own layers' columns."""
    model, g, spec = learner.model, learner.groups, learner.spec
    if not spec.is_moe:
        raise ValueError("inputs.values.router: true needs an MoE policy (this one has no router)")
    E, moe = int(spec.num_experts), list(spec.moe_layers)
    mbs = batch.split(micro_batches)
    out = torch.zeros(batch.num_tokens, len(moe) * E, dtype=torch.float32)
    offsets = torch.cumsum(torch.tensor([0] + [mb.num_tokens for mb in mbs]), 0).tolist()
    pairs, calls = [], {}
    for i, layer in decoder_layers(model).items():
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is None or i not in moe:
            continue
        col = moe.index(i) * E

        def hook(_m, _args, res, col=col, key=i):
            probs = (res[0] if isinstance(res, tuple) else res).detach().reshape(-1, E)  # [s(/tp), E]
            if g.layout.sequence_parallel and g.layout.tp > 1:
                parts = [torch.empty_like(probs) for _ in range(g.layout.tp)]
                dist.all_gather(parts, probs.contiguous(), group=g.tp)
                probs = torch.cat(parts, 0)
            idx = calls.get(key, 0)
            calls[key] = idx + 1
            a, n = offsets[idx], mbs[idx].num_tokens
            out[a : a + n, col : col + E] = probs[:n].float().cpu()

        pairs.append((router, hook))
    run_probe(learner, batch, micro_batches, pairs)
    return _all_reduce(out, g.pp, g.layout.pp, g.device)
