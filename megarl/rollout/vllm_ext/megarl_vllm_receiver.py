"""Worker extension of a vLLM server: receive the policy's weights from the trainer over a
point-to-point gloo group, without a checkpoint on disk.

Runs in the vLLM venv (``--worker-extension-cls megarl_vllm_receiver.MegarlWeightReceiver``, this
directory on PYTHONPATH); imports only the standard library and torch. Every vLLM worker (one per
TP/PP rank) joins one group with the trainer (rank 0, which hosts the store): worker ``r`` is rank
``1 + r``. The methods are called through ``/collective_rpc`` with JSON string arguments.

The stream of one sync, every message broadcast from rank 0 (megarl/rollout/memory_sync.py writes
it): per bucket an int64 header length, the header (UTF-8 JSON: ``[[name, dtype, shape], ...]``)
and then each tensor's bytes; a header length of 0 ends the sync, -1 aborts it. The
workers feed the tensors to vLLM's in-place reload as they arrive (no second full copy of the
model) and return the CRC-32 of every bucket, which the trainer compares with its own.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

END, ABORT = 0, -1


class SyncAborted(RuntimeError):
    """The trainer aborted the sync part-way (the weights are partly new)."""


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def crc32(buf: torch.Tensor, value: int = 0) -> int:
    """CRC-32 of a uint8 CPU buffer's bytes, continuing from ``value`` (chains over tensors)."""
    return zlib.crc32(memoryview(buf.numpy()), value) if buf.numel() else value


def receive_buckets(group, crcs: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a sync stream on ``group`` as each tensor arrives; appends each
    bucket's CRC-32 (over its tensors' bytes in order) to ``crcs``. Raises ``SyncAborted`` on the
    abort marker."""
    while True:
        length = torch.zeros(1, dtype=torch.int64)
        group.broadcast(length, 0).wait()
        n = int(length.item())
        if n == END:
            return
        if n == ABORT:
            raise SyncAborted("the trainer aborted the weight sync part-way")
        header = torch.empty(n, dtype=torch.uint8)
        group.broadcast(header, 0).wait()
        value = 0
        for name, dt, shape in json.loads(bytes(header.numpy())):
            t = torch.empty(shape, dtype=getattr(torch, dt))
            group.broadcast(byte_view(t), 0).wait()
            value = crc32(byte_view(t), value)
            yield name, t
        crcs.append(value)


class MegarlWeightReceiver:
    """Methods mixed into vLLM's worker class (names prefixed so they cannot clash with its own)."""

    def megarl_count_workers(self) -> str:
        """One answer per worker: how the trainer learns the group's size."""
        return f"worker {int(getattr(self, 'rank', 0))}"

    def megarl_open_channel(self, channel: str) -> str:
        """Join the trainer's group: ``channel`` = JSON {host, port, world_size, timeout_s}."""
        c = json.loads(channel)
        rank = 1 + int(getattr(self, "rank", 0))
        timeout = timedelta(seconds=float(c["timeout_s"]))
        store = dist.TCPStore(
            c["host"], int(c["port"]), int(c["world_size"]), is_master=False, timeout=timeout
        )
        self._megarl_group = dist.ProcessGroupGloo(store, rank, int(c["world_size"]), timeout)
        self._megarl_store = store
        return f"rank {rank} joined"

    def megarl_close_channel(self) -> str:
        """Leave the group (the trainer closes its side too)."""
        self._megarl_group = None
        self._megarl_store = None
        return "closed"

    def megarl_receive_weights(self) -> dict:
        """Receive one sync stream and reload its tensors in place; returns the buckets' CRC-32s."""
        if getattr(self, "_megarl_group", None) is None:
            raise RuntimeError("megarl_receive_weights: no channel open (megarl_open_channel first)")
        crcs: list[int] = []
        self.reload_weights(  # type: ignore[attr-defined]  (vLLM's worker method)
            weights_iterator=receive_buckets(self._megarl_group, crcs), is_checkpoint_format=True
        )
        return {"crc32": crcs}
