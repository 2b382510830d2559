"""Trainer side of the in-memory weight sync to a vLLM server (no checkpoint on disk).

The trainer hosts a TCP store and joins a gloo group of ``1 + workers`` ranks with the server's
workers (megarl/rollout/vllm_ext/megarl_vllm_receiver.py); each sync sends the HF-named tensors in
buckets, one flat byte buffer per bucket broadcast from rank 0, while the server reloads them in
place as they arrive. Gloo runs over TCP on CPU and on GPU hosts alike (a GPU run stages the tensors
through host memory; an NCCL channel is the faster path there and is not built here).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 256 << 20
RECEIVER_CLASS = "megarl_vllm_receiver.MegarlWeightReceiver"


def plan_buckets(
    state: dict[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of ``state``'s tensors of at most ``bucket_bytes`` each (a larger tensor
    gets a bucket of its own), in ``state``'s order."""
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += nbytes
    return [b for b in buckets if b]


def manifest(buckets: list[list[tuple[str, torch.Tensor]]]) -> str:
    """What the receiver needs to split each bucket: JSON {"buckets": [[[name, dtype, shape], ...]]}."""
    return json.dumps(
        {
            "buckets": [
                [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in bucket]
                for bucket in buckets
            ]
        }
    )


def flat_bytes(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """One bucket as a flat uint8 CPU buffer (the tensors' bytes back to back)."""
    parts = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def channel_host(server_url: str) -> str:
    """The address the server's workers reach the trainer at: loopback for a local server, else
    this host's name."""
    host = server_url.split("://")[-1].split("/")[0].rsplit(":", 1)[0].strip("[]")
    return "127.0.0.1" if host in ("127.0.0.1", "localhost", "::1") else socket.getfqdn()


@dataclass
class WeightChannel:
    """The trainer's end of one server's channel: the store it hosts and, once joined, the group."""

    host: str
    port: int
    world_size: int
    timeout_s: float
    store: dist.TCPStore
    group: object | None = None

    @classmethod
    def host_store(cls, host: str, world_size: int, timeout_s: float = 300.0) -> WeightChannel:
        """Open the store on a free port of ``host`` (the workers connect to it)."""
        store = dist.TCPStore(
            host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        return cls(host, store.port, world_size, timeout_s, store)

    def invitation(self) -> str:
        """The JSON the workers' ``megarl_open_channel`` takes."""
        return json.dumps(
            {"host": self.host, "port": self.port, "world_size": self.world_size, "timeout_s": self.timeout_s}
        )

    def join(self) -> None:
        """Join the group as rank 0 (blocks until every worker has joined)."""
        self.group = dist.ProcessGroupGloo(self.store, 0, self.world_size, timedelta(seconds=self.timeout_s))

    def send(self, buckets: list[list[tuple[str, torch.Tensor]]]) -> int:
        """Broadcast every bucket from rank 0; returns the bytes sent."""
        if self.group is None:
            raise RuntimeError("weight channel: send before join")
        sent = 0
        for bucket in buckets:
            buf = flat_bytes(bucket)
            self.group.broadcast(buf, 0).wait()  # type: ignore[attr-defined]
            sent += buf.numel()
        return sent
