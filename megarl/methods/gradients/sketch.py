"""Per-sequence JL sketches of the gradient, from one backward pass (module hooks, no per-sample backward).

A linear layer applied token by token has the weight gradient ``G = sum_t d_t x_tᵀ`` (``x_t`` its
input, ``d_t`` the gradient at its output). With a packed batch and block-diagonal attention, the
tokens of sequence ``s`` reach the loss only through sequence ``s``'s own share, so the share of
``G`` from sequence ``s``, ``G_s = sum_{t in s} d_t x_tᵀ``, is that sequence's gradient exactly.
Its Kronecker JL sketch ``A G_s Bᵀ`` (``A``: r x m, ``B``: r x n, entries N(0, 1/r)) is
``sum_{t in s} (A d_t)(B x_t)ᵀ``: an r x r matrix per sequence, accumulated from hooks on the
forward (``B x_t``) and the backward (``A d_t``) of one pass. The sketches of all sketched layers
are summed into one vector of size r² per sequence; independent projections per layer make the sum
a JL projection of the concatenated gradient (``E <S g, S h> = <g, h>``).

Sharding: each rank uses the columns of ``A`` / ``B`` of its weight shard (column-parallel: rows
of W, so columns of A; row-parallel: columns of W, so columns of B), with the sequence-parallel
shards of ``x`` (column-parallel) or ``d`` (row-parallel) gathered over the TP group first; the
per-rank partial sketches are then summed over the world (TP shards, pipeline stages and
data-parallel replicas each hold a disjoint part).

Sketched: megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` of the attention and the
dense MLPs, and the output layer (its use of a tied weight only). Not sketched: MoE experts (their
tokens are permuted), the router, norms and embeddings.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from megarl.batch import PackedBatch


def seeded_gaussian(rows: int, cols: int, seed: int, name: str) -> torch.Tensor:
    """An ``rows x cols`` matrix of N(0, 1/rows) entries, the same on every rank for (seed, name)."""
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "little")
    g = torch.Generator().manual_seed(key)
    return torch.randn(rows, cols, generator=g, dtype=torch.float64) / rows**0.5


def token_sketches(ad: torch.Tensor, bx: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """``[num_seqs, r*r]``: per sequence, ``sum_t (A d_t)(B x_t)ᵀ`` flattened, from ``ad`` [T, r],
    ``bx`` [T, r] and ``seq`` [T] (the sequence of each token, -1: none)."""
    keep = seq >= 0
    outer = ad[keep, :, None] * bx[keep, None, :]
    out = torch.zeros(num_seqs, ad.shape[1] * bx.shape[1], dtype=torch.float64, device=ad.device)
    return out.index_add_(0, seq[keep], outer.reshape(outer.shape[0], -1).double())


def _linear_kind(module: torch.nn.Module) -> str | None:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if getattr(module, "is_expert", False):
        return None
    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    return None


def sketched_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """(name, module, 'column' | 'row') of every linear layer the sketch covers."""
    return [(n, m, k) for n, m in model.named_modules() if (k := _linear_kind(m)) is not None]


def _gather_tokens(t: torch.Tensor, group: Any) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, 0)


class GroupSketcher:
    """Hooks on the sketched linear layers of ``model`` that accumulate per-sequence sketches
    ``[num_seqs, rank²]`` while ``attached`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tp_group: Any, rank: int, seed: int):
        self.model, self.tp_group, self.r, self.seed = model, tp_group, rank, seed
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.modules = sketched_modules(model)
        if not self.modules:
            raise ValueError("gradient sketch: the model has no megatron-core parallel linear layer to hook")
        self._proj: dict[tuple[str, str], torch.Tensor] = {}
        self.acc: torch.Tensor | None = None
        self._token_seq: list[torch.Tensor] = []

    def _slice(self, name: str, side: str, local: int, sharded: bool, device) -> torch.Tensor:
        """This rank's columns of the projection ``side`` ('A' or 'B') of layer ``name``."""
        key = (name, side)
        if key not in self._proj:
            full = local * self.tp if sharded else local
            m = seeded_gaussian(self.r, full, self.seed, f"{name}:{side}")
            if sharded:
                m = m[:, self.tp_rank * local : (self.tp_rank + 1) * local]
            self._proj[key] = m.to(device=device, dtype=torch.float32).contiguous()
        return self._proj[key]

    def _hook(self, name: str, kind: str):
        counter = [0]

        def forward_hook(module, inputs, output):
            if self.acc is None or not torch.is_grad_enabled():
                return
            seq = self._token_seq[counter[0] % len(self._token_seq)].to(self.acc.device)
            counter[0] += 1
            sp = self.tp > 1 and getattr(module, "sequence_parallel", False)
            x = inputs[0].detach()
            x = x.reshape(-1, x.shape[-1])
            if kind == "column" and sp:
                x = _gather_tokens(x, self.tp_group)
            bx = x.float() @ self._slice(name, "B", x.shape[-1], kind == "row", x.device).T
            out = output[0] if isinstance(output, tuple) else output

            def backward_hook(grad):
                d = grad.detach().reshape(-1, grad.shape[-1])
                if kind == "row" and sp:
                    d = _gather_tokens(d, self.tp_group)
                ad = d.float() @ self._slice(name, "A", d.shape[-1], kind == "column", d.device).T
                n = min(ad.shape[0], seq.shape[0])
                self.acc += token_sketches(ad[:n], bx[:n], seq[:n], self.acc.shape[0])

            out.register_hook(backward_hook)

        return forward_hook

    @contextmanager
    def attached(
        self, micro_batches: list[PackedBatch], seq_index: list[torch.Tensor], num_seqs: int, pad: int
    ):
        """Accumulate into ``self.acc`` [num_seqs, r²] while a schedule runs ``micro_batches`` (in
        order on every stage); ``seq_index[k]`` [B_k]: the row of each sequence of micro-batch k;
        ``pad``: tokens are padded to a multiple of it (sequence parallelism)."""
        self._token_seq = []
        for mb, idx in zip(micro_batches, seq_index):
            lens = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).long()
            seq = torch.repeat_interleave(idx.long(), lens)
            extra = -mb.num_tokens % pad
            self._token_seq.append(torch.cat([seq, torch.full((extra,), -1, dtype=torch.long)]))
        device = next(self.model.parameters()).device
        self.acc = torch.zeros(num_seqs, self.r * self.r, dtype=torch.float64, device=device)
        handles = [m.register_forward_hook(self._hook(n, k)) for n, m, k in self.modules]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def release(self) -> torch.Tensor:
        """The accumulated sketches (this rank's part), and detach from them."""
        out, self.acc = self.acc, None
        return out


def sequence_sketches(
    learner: Any,
    sketcher: GroupSketcher,
    batch: PackedBatch,
    seq_rows: torch.Tensor,
    num_seqs: int,
    objective: Any,
    num_micro_batches: int,
    normalisers: Any,
) -> torch.Tensor:
    """``[num_seqs, r²]`` sketches of the per-sequence gradients of ``objective`` (collective: every
    rank passes its data-parallel share ``batch``, whose sequence ``j`` is row ``seq_rows[j]``); the
    partial sketches of all ranks are summed over the world."""
    micro = batch.split(num_micro_batches)
    rows, at = [], 0
    for mb in micro:
        rows.append(seq_rows[at : at + mb.num_seqs])
        at += mb.num_seqs
    pad = learner.groups.layout.tp if learner.groups.layout.sequence_parallel else 1
    with sketcher.attached(micro, rows, num_seqs, pad):
        learner.backward_pass(batch, objective, num_micro_batches, normalisers)
    acc = sketcher.release()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(acc)
    return acc.cpu()
