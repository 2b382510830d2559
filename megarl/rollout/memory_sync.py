"""Trainer side of the in-memory weight sync to a vLLM server (no checkpoint on disk).

The trainer hosts a TCP store and joins a group of ``1 + workers`` ranks with the server's workers
(megarl/rollout/vllm_ext/megarl_vllm_receiver.py, which also defines the stream: per bucket a
header length, a JSON header of names, dtypes and shapes, each tensor's bytes; 0 ends, -1 aborts).
Buckets are sent as they come, so a caller can stream them straight from the learner's gather
without a full copy of the model.

The backend follows the workers' device, as for SGLang (``choose_backend``): gloo for CPU
workers, NCCL for CUDA ones, except that a server on this trainer's own GPU (colocated) gets gloo
too, because NCCL cannot put two ranks on one GPU (the workers report their GPU's UUID and host;
a colocated server's fast path would be CUDA IPC, which is not built). The stream is the same on
both; what differs is where the bytes lie:

- gloo: every tensor is copied to host memory and sent over TCP; each bucket's checksum is the
  CRC-32 of its bytes.
- NCCL: every message is a tensor on this process's current CUDA device (read when the channel is
  opened, because the sends run in another thread, whose current device would otherwise be 0); the
  learner's tensors are broadcast where they lie, GPU to GPU, never staged through host memory (a
  tensor on the host or another GPU is first copied to that device). The checksum is
  ``device_digest``, computed on the GPU on both ends and folded per bucket on the host: one host
  sync per bucket. The trainer refuses an NCCL channel when torch sees no CUDA device (the error
  names ``rollout.weight_sync``), and CUDA is touched only on that path, never at import.
  This path has not been executed on a GPU (docs/gpu.md says what is checked); the ``nccl sync``
  check of benchmarks/gpu/check.py runs it on a machine with two GPUs (docs/gpu.md).

A sync that fails part-way leaves the server's weights partly new: the client marks the server dead
on either backend. On NCCL a host wait never blocks for good: the trainer polls the device with a
deadline (``timeout_s``) and a cancel flag (``WeightChannel.cancel``, set by the client when the
workers' RPC fails first), and then aborts the communicator (``ProcessGroupNCCL.abort``).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.rollout.sglang_sync import backend_for_device
from megarl.rollout.types import RolloutError
from megarl.rollout.vllm_ext.megarl_vllm_receiver import (
    ABORT,
    BACKENDS,
    END,
    byte_view,
    crc32,
    device_digest,
    fold_digests,
    gpu_uuid,
    nccl_group,
)

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


def url_host(server_url: str) -> str:
    """The host part of a server URL ("http://[::1]:8000/v1" -> "::1")."""
    return server_url.split("://")[-1].split("/")[0].rsplit(":", 1)[0].strip("[]")


def channel_host(server_url: str) -> str:
    """The address the server's workers reach the trainer at: loopback for a local server, else
    this host's name."""
    host = url_host(server_url)
    return "127.0.0.1" if host in ("127.0.0.1", "localhost", "::1") else socket.getfqdn()


def sglang_workers(info: dict, server_url: str) -> list[dict]:
    """An SGLang server's TP ranks as ``choose_backend`` sees workers, from its ``/server_info``:
    device, host and, for a CUDA server on this host, the UUID of the GPU each rank uses
    (``base_gpu_id + rank * gpu_id_step`` read with this process's device numbering, so a server
    started under another ``CUDA_VISIBLE_DEVICES`` is not recognised as sharing a GPU)."""
    device = str(info.get("device", "cuda"))
    server_host = url_host(server_url)
    local = channel_host(server_url) == "127.0.0.1" or server_host in (socket.gethostname(), socket.getfqdn())
    host = socket.gethostname() if local else server_host
    base, step = int(info.get("base_gpu_id", 0)), int(info.get("gpu_id_step", 1))
    workers = []
    for rank in range(int(info.get("tp_size", 1))):
        gpu = None
        index = base + rank * step
        if device == "cuda" and local and torch.cuda.is_available() and index < torch.cuda.device_count():
            gpu = gpu_uuid(torch.device("cuda", index))
        workers.append(
            {"device": device if device == "cpu" else f"{device}:{index}", "host": host, "gpu": gpu}
        )
    return workers


def backend_for_workers(devices: list[str]) -> str:
    """The backend for workers on ``devices`` (their ``megarl_worker_device`` answers, e.g. "cpu",
    "cuda:0"): gloo when all are on the CPU, nccl when all are on CUDA."""
    kinds = sorted({d.split(":")[0] for d in devices})
    if len(kinds) != 1:
        raise RolloutError(f"in-memory weight sync: the workers are on {devices}: one device type expected")
    return backend_for_device(kinds[0])


def sync_cuda_device(what: str) -> torch.device:
    """This process's current CUDA device, the trainer's end of an NCCL channel to ``what``; a
    clear error, naming the config key, when torch sees none (nothing is touched on CUDA before)."""
    if not torch.cuda.is_available():
        raise RolloutError(
            f"in-memory weight sync to {what} needs NCCL (the server's workers are on CUDA, or NCCL "
            "was asked for), but this trainer process has no CUDA device (torch.cuda.is_available() "
            "is False): set rollout.weight_sync: disk, or run the trainer on a GPU host"
        )
    return torch.device("cuda", torch.cuda.current_device())


def choose_backend(workers: list[dict], what: str, requested: str | None = None) -> str:
    """The channel's backend for workers that answered ``workers`` (``megarl_worker_device``:
    device, GPU UUID, host). ``requested`` None follows their device: gloo for CPU workers, NCCL
    for CUDA ones, except gloo again for a server that shares this trainer's GPU (NCCL cannot put
    two ranks on one GPU). NCCL asked for or chosen raises ``RolloutError`` when this process has
    no CUDA device, and an NCCL request for CPU workers or a shared GPU raises too."""
    by_device = backend_for_workers([str(w["device"]) for w in workers])
    backend = requested or by_device
    if backend == "gloo":
        return "gloo"
    if by_device != "nccl":
        raise RolloutError(
            f"{what}: an NCCL weight channel needs CUDA workers, the server's are on "
            f"{[w['device'] for w in workers]}: use the gloo channel (their default) or "
            "rollout.weight_sync: disk"
        )
    mine = (socket.gethostname(), gpu_uuid(sync_cuda_device(what)))
    if mine[1] is not None and any((w.get("host"), w.get("gpu")) == mine for w in workers):
        if requested == "nccl":
            raise RolloutError(
                f"{what}: a server worker is on this trainer's GPU ({mine[1]}), and NCCL cannot put "
                "two ranks on one GPU: use the gloo channel (the default for a colocated server)"
            )
        return "gloo"
    return "nccl"


def stream_on_device(
    broadcast: Callable[[torch.Tensor], None],
    buckets: Iterable[Bucket],
    device: torch.device,
    to_host: Callable[[torch.Tensor], list],
) -> list[int]:
    """Send the stream with every message a tensor on ``device`` (the NCCL path; any device works
    with a group that takes it); returns each bucket's ``fold_digests`` of its tensors'
    ``device_digest``. ``to_host`` reads the digests back (one host sync per bucket). An error while
    the buckets are produced sends the abort marker and is re-raised."""

    def length(n: int) -> None:
        broadcast(torch.tensor([n], dtype=torch.int64, device=device))

    values = []
    try:
        for bucket in buckets:
            header = bucket_header(bucket)
            length(len(header))
            broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device))
            pairs = []
            for t in bucket.values():  # broadcast where it lies: no host copy
                src = t.detach().to(device).contiguous()
                broadcast(byte_view(src))
                pairs.append(device_digest(src))
            values.append(fold_digests(to_host(torch.stack(pairs)) if pairs else []))
    except BaseException:
        try:
            length(ABORT)
        except Exception:  # the group itself broke: the receivers time out
            pass
        raise
    length(END)
    return values


@dataclass
class WeightChannel:
    """The trainer's end of one server's channel: the store it hosts and, once joined, the group."""

    host: str
    port: int
    world_size: int
    timeout_s: float
    store: dist.TCPStore
    group: object | None = None
    backend: str = "gloo"
    device: torch.device | None = None  # nccl: the trainer's CUDA device
    _cancelled: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def host_store(
        cls, host: str, world_size: int, timeout_s: float = 300.0, backend: str = "gloo"
    ) -> WeightChannel:
        """Open the store on a free port of ``host`` (the workers connect to it). ``backend="nccl"``
        needs a CUDA device in this process (its current one is used)."""
        if backend not in BACKENDS:
            raise ValueError(f"in-memory weight sync: backend must be gloo or nccl, got {backend!r}")
        device = sync_cuda_device(f"{host}'s workers") if backend == "nccl" else None
        store = dist.TCPStore(
            host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        return cls(host, store.port, world_size, timeout_s, store, backend=backend, device=device)

    @property
    def checksum_key(self) -> str:
        """The key of the workers' answer that holds the bucket checksums."""
        return "crc32" if self.backend == "gloo" else "digest"

    def invitation(self) -> str:
        """The JSON the workers' ``megarl_open_channel`` takes (gloo: the same JSON as always)."""
        c = {"host": self.host, "port": self.port, "world_size": self.world_size, "timeout_s": self.timeout_s}
        return json.dumps(c if self.backend == "gloo" else c | {"backend": self.backend})

    def join(self) -> None:
        """Join the group as rank 0 (blocks until every worker has joined)."""
        if self.backend == "gloo":
            self.group = dist.ProcessGroupGloo(
                self.store, 0, self.world_size, timedelta(seconds=self.timeout_s)
            )
            return
        with torch.cuda.device(self.device):  # this may run in another thread than host_store
            # twice the deadline of _to_host, so that this side aborts before torch's watchdog
            # handles the timeout (by default it ends the process)
            group = nccl_group(self.store, 0, self.world_size, timedelta(seconds=2 * self.timeout_s))
            self.group = group
            hello = torch.tensor([self.world_size], dtype=torch.int64, device=self.device)
            self._broadcast(hello)  # the workers' megarl_open_channel receives it
            self._to_host(hello)

    def cancel(self) -> None:
        """Stop a send waiting on the device (NCCL: it aborts the group and raises); no effect on
        gloo, whose broadcasts fail by themselves when a worker goes away."""
        self._cancelled.set()

    def _to_host(self, t: torch.Tensor) -> list:
        """``t.tolist()`` once the device is done, polling so that a cancel or the deadline aborts
        the communicator instead of waiting for good."""
        if t.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            deadline = time.monotonic() + self.timeout_s
            while not done.query():
                if self._cancelled.is_set() or time.monotonic() > deadline:
                    why = (
                        "cancelled" if self._cancelled.is_set() else f"no progress in {self.timeout_s:.0f} s"
                    )
                    self.group.abort()  # type: ignore[attr-defined]  (ProcessGroupNCCL)
                    self.group = None
                    raise RuntimeError(f"weight channel: NCCL sync stopped ({why}); communicator aborted")
                time.sleep(0.001)
        return t.tolist()

    def _broadcast(self, t: torch.Tensor) -> None:
        self.group.broadcast(t, 0).wait()  # type: ignore[attr-defined]

    def _length(self, n: int) -> None:
        self._broadcast(torch.tensor([n], dtype=torch.int64))

    def send(self, buckets: Iterable[Bucket]) -> list[int]:
        """Stream every bucket, then the end marker; returns the buckets' checksums (gloo: CRC-32s;
        NCCL: ``fold_digests`` of ``device_digest``). An error while the buckets are produced sends
        the abort marker (the receivers stop) and is re-raised."""
        if self.group is None:
            raise RuntimeError("weight channel: send before join")
        if self.backend == "nccl":
            with torch.cuda.device(self.device):  # the caller's thread; the learner's gathers too
                return stream_on_device(self._broadcast, buckets, self.device, self._to_host)  # type: ignore[arg-type]
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
