"""Trainer side of the in-memory weight sync to a vLLM server (no checkpoint on disk).

The trainer hosts a TCP store and joins a gloo group of ``1 + workers`` ranks with the server's
workers (megarl/rollout/vllm_ext/megarl_vllm_receiver.py, which also defines the stream: per bucket
a header length, a JSON header of names, dtypes and shapes, each tensor's bytes; 0 ends, -1 aborts).
Buckets are sent as they come, so a caller can stream them straight from the learner's gather
without a full copy of the model. Gloo runs over TCP on CPU and GPU hosts alike (a GPU run stages
the tensors through host memory; an NCCL channel, the fast path there, is not built).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.rollout.vllm_ext.megarl_vllm_receiver import ABORT, END, byte_view, crc32

DEFAULT_BUCKET_BYTES = 256 << 20
RECEIVER_CLASS = "megarl_vllm_receiver.MegarlWeightReceiver"
Bucket = dict[str, torch.Tensor]


def plan_buckets(state: dict[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Consecutive groups of ``state``'s tensors of at most ``bucket_bytes`` each (a larger tensor
    gets a bucket of its own), in ``state``'s order."""
    buckets: list[Bucket] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append({})
            size = 0
        buckets[-1][name] = t
        size += nbytes
    return [b for b in buckets if b]


def bucket_header(bucket: Bucket) -> bytes:
    """The JSON header of one bucket: ``[[name, dtype, shape], ...]``."""
    return json.dumps(
        [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in bucket.items()]
    ).encode()


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

    def _broadcast(self, t: torch.Tensor) -> None:
        self.group.broadcast(t, 0).wait()  # type: ignore[attr-defined]

    def _length(self, n: int) -> None:
        self._broadcast(torch.tensor([n], dtype=torch.int64))

    def send(self, buckets: Iterable[Bucket]) -> list[int]:
        """Stream every bucket, then the end marker; returns the buckets' CRC-32s. An error while
        the buckets are produced sends the abort marker (the receivers stop) and is re-raised."""
        if self.group is None:
            raise RuntimeError("weight channel: send before join")
        crcs = []
        try:
            for bucket in buckets:
                header = bucket_header(bucket)
                self._length(len(header))
                self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))
                value = 0
                for t in bucket.values():  # each tensor's own bytes: no concatenated copy
                    raw = byte_view(t.detach().to("cpu").contiguous())
                    self._broadcast(raw)
                    value = crc32(raw, value)
                crcs.append(value)
        except BaseException:
            try:
                self._length(ABORT)
            except Exception:  # the group itself broke: the receivers time out
                pass
            raise
        self._length(END)
        return crcs
