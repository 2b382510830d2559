"""Worker extension of a vLLM server: receive the policy's weights from the trainer over a
point-to-point gloo group, without a checkpoint on disk.

Runs in the vLLM venv (``--worker-extension-cls megarl_vllm_receiver.MegarlWeightReceiver``, this
directory on PYTHONPATH); imports only the standard library and torch. Every vLLM worker (one per
TP/PP rank) joins one group with the trainer (rank 0, which hosts the store): worker ``r`` is rank
``1 + r``. The trainer sends the HF-named tensors in buckets, each bucket one flat byte buffer
broadcast from rank 0; the workers feed them to vLLM's in-place reload as they arrive, so no full
second copy of the model is held. The methods are called through ``/collective_rpc`` with JSON
string arguments.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist


class MegarlWeightReceiver:
    """Methods mixed into vLLM's worker class (names prefixed so they cannot clash with its own)."""

    def megarl_count_workers(self) -> str:
        """One answer per worker: how the trainer learns the group's size."""
        return f"worker {int(getattr(self, 'rank', 0))}"

    def megarl_open_channel(self, channel: str) -> str:
        """Join the trainer's group: ``channel`` = JSON {host, port, world_size, timeout_s}."""
        c = json.loads(channel)
        rank = 1 + int(getattr(self, "rank", 0))
        store = dist.TCPStore(
            c["host"],
            int(c["port"]),
            int(c["world_size"]),
            is_master=False,
            timeout=timedelta(seconds=float(c["timeout_s"])),
        )
        self._megarl_group = dist.ProcessGroupGloo(
            store, rank, int(c["world_size"]), timedelta(seconds=float(c["timeout_s"]))
        )
        self._megarl_store = store
        return f"rank {rank} joined"

    def megarl_close_channel(self) -> str:
        """Leave the group (the trainer closes its side too)."""
        self._megarl_group = None
        self._megarl_store = None
        return "closed"

    def _megarl_stream(self, buckets: list) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs as each bucket arrives. ``buckets``: [[[name, dtype, shape], ...], ...]."""
        for bucket in buckets:
            specs = [(name, getattr(torch, dtype), tuple(shape)) for name, dtype, shape in bucket]
            sizes = [
                torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size() for _, dt, shape in specs
            ]
            buf = torch.empty(sum(sizes), dtype=torch.uint8)
            self._megarl_group.broadcast(buf, 0).wait()
            offset = 0
            for (name, dt, shape), size in zip(specs, sizes):
                yield name, buf[offset : offset + size].view(dt).view(shape)
                offset += size

    def megarl_receive_weights(self, manifest: str) -> str:
        """Receive the buckets ``manifest`` (JSON {"buckets": [...]}) lists and reload them in place."""
        buckets = json.loads(manifest)["buckets"]
        if getattr(self, "_megarl_group", None) is None:
            raise RuntimeError("megarl_receive_weights: no channel open (megarl_open_channel first)")
        self.reload_weights(weights_iterator=self._megarl_stream(buckets), is_checkpoint_format=True)
        return f"{sum(len(b) for b in buckets)} tensors"
