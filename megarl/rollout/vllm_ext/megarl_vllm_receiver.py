"""Worker extension of a vLLM server: receive the policy's weights from the trainer over a
point-to-point torch.distributed group, without a checkpoint on disk.

Runs in the vLLM venv (``--worker-extension-cls megarl_vllm_receiver.MegarlWeightReceiver``, this
directory on PYTHONPATH); imports only the standard library and torch (CUDA is touched only on the
NCCL path, never at import). Every vLLM worker (one per TP/PP rank) joins one group with the
trainer (rank 0, which hosts the store): worker ``r`` is rank ``1 + r``. The methods are called
through ``/collective_rpc`` with JSON string arguments.

The stream of one sync, every message broadcast from rank 0 (megarl/rollout/memory_sync.py writes
it): per bucket an int64 header length, the header (UTF-8 JSON: ``[[name, dtype, shape], ...]``)
and then each tensor's bytes; a header length of 0 ends the sync, -1 aborts it. The
workers feed the tensors to vLLM's in-place reload as they arrive (no second full copy of the
model) and return one checksum per bucket, which the trainer compares with its own.

The backend follows the workers' device (the trainer reads it with ``megarl_worker_device`` and
names it in the invitation):

- gloo (CPU workers): the messages are CPU tensors sent over TCP; the checksum is the CRC-32 of
  each bucket's bytes (answered as ``{"crc32": [...]}``).
- NCCL (CUDA workers on other GPUs than the trainer's): the same messages as tensors on the
  worker's GPU (``self.device``), so the weights go GPU to GPU and are never staged through host
  memory (only the length and the header, a few bytes, are read back to the host). CRC-32 would
  need the bytes on the host, so the checksum is ``device_digest``, computed on the GPU where the
  tensor lies, folded per bucket on the host (answered as ``{"digest": [...]}``). This path has
  not been executed on a GPU (docs/gpu.md says what is checked); the ``nccl sync`` check of
  benchmarks/gpu/check.py runs it on a machine with two GPUs (docs/gpu.md).
"""

from __future__ import annotations

import json
import socket
import zlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

END, ABORT = 0, -1
BACKENDS = ("gloo", "nccl")
# device_digest: int16 words are weighted by (position mod DIGEST_MOD) + 1, DIGEST_CHUNK words at a
# time (a multiple of DIGEST_MOD, so every chunk uses the same weights): 8 MiB of the tensor per step
DIGEST_MOD = 65521
DIGEST_CHUNK = DIGEST_MOD * 64
MASK64 = (1 << 64) - 1


class SyncAborted(RuntimeError):
    """The trainer aborted the sync part-way (the weights are partly new)."""


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy; on the tensor's device)."""
    return t.reshape(-1).view(torch.uint8)


def crc32(buf: torch.Tensor, value: int = 0) -> int:
    """CRC-32 of a uint8 CPU buffer's bytes, continuing from ``value`` (chains over tensors)."""
    return zlib.crc32(memoryview(buf.numpy()), value) if buf.numel() else value


_WEIGHTS: dict[str, torch.Tensor] = {}


def _digest_weights(device: torch.device) -> torch.Tensor:
    """int32 [DIGEST_CHUNK]: (i mod DIGEST_MOD) + 1, cached per device."""
    key = str(device)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = torch.arange(DIGEST_CHUNK, dtype=torch.int32, device=device) % DIGEST_MOD + 1
    return _WEIGHTS[key]


def device_digest(t: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of a contiguous tensor's bytes, computed where the tensor lies:
    int64 [2] on ``t.device`` = (sum of w_i, sum of w_i * ((i mod 65521) + 1)) over the bytes read
    as little-endian int16 words w_i (an odd last byte is one more word). Integer sums are exact,
    so the value is the same on any device and in any reduction order; the weights make it depend
    on where each word lies, not only on the multiset of words (a Fletcher-style check: it catches
    a changed, dropped or misplaced word, not a deliberate collision). No host copy; transient
    memory under 64 MiB (plus 16 MiB of cached weights per device)."""
    raw = byte_view(t)
    n = raw.numel()
    words = raw[: n - n % 2].view(torch.int16)
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    if words.numel():
        weights = _digest_weights(t.device)
        for start in range(0, words.numel(), DIGEST_CHUNK):  # bounded temporaries per step
            w = words[start : start + DIGEST_CHUNK].to(torch.int32)
            out[0] += w.sum(dtype=torch.int64)
            # |w| <= 2^15 and weight <= 65521: each product fits int32; sums are int64
            out[1] += (w * weights[: w.numel()]).sum(dtype=torch.int64)
    if n % 2:
        last = raw[n - 1 :].to(torch.int64)
        out[0] += last.sum()
        out[1] += last.sum() * (words.numel() % DIGEST_MOD + 1)
    return out


def fold_digests(pairs: list[list[int]]) -> int:
    """One bucket's checksum from its tensors' ``device_digest`` values in order (host ints)."""
    value = 0
    for a, b in pairs:
        value = ((value * 0x100000001B3) ^ (a & MASK64)) & MASK64
        value = ((value * 0x100000001B3) ^ (b & MASK64)) & MASK64
    return value


def _next_header(group, device: torch.device | None = None) -> list | None:
    """The next bucket's header (its tensors' names, dtypes and shapes), None at the end marker;
    raises ``SyncAborted`` on the abort marker. The messages lie on ``device`` (None: the host)."""
    length = torch.zeros(1, dtype=torch.int64, device=device)
    group.broadcast(length, 0).wait()
    n = int(length.item())
    if n == END:
        return None
    if n == ABORT:
        raise SyncAborted("the trainer aborted the weight sync part-way")
    header = torch.empty(n, dtype=torch.uint8, device=device)
    group.broadcast(header, 0).wait()
    return json.loads(bytes(header.cpu().numpy()))


def receive_buckets(group, crcs: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a sync stream on a gloo ``group`` as each tensor arrives; appends
    each bucket's CRC-32 (over its tensors' bytes in order) to ``crcs``. Raises ``SyncAborted`` on
    the abort marker."""
    while (header := _next_header(group)) is not None:
        value = 0
        for name, dt, shape in header:
            t = torch.empty(shape, dtype=getattr(torch, dt))
            group.broadcast(byte_view(t), 0).wait()
            value = crc32(byte_view(t), value)
            yield name, t
        crcs.append(value)


def receive_buckets_on_device(
    group, digests: list[int], device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """The same stream received into tensors on ``device`` (an NCCL group: the worker's GPU);
    appends each bucket's ``fold_digests`` of its tensors' ``device_digest`` to ``digests``. One
    host sync per bucket (the header) plus one for its digests."""
    while (header := _next_header(group, device)) is not None:
        pairs = []
        for name, dt, shape in header:
            t = torch.empty(shape, dtype=getattr(torch, dt), device=device)
            group.broadcast(byte_view(t), 0).wait()  # the stream waits for the broadcast
            pairs.append(device_digest(t))  # queued before vLLM's loader touches the tensor
            yield name, t
        digests.append(fold_digests(torch.stack(pairs).tolist() if pairs else []))


def gpu_uuid(device: torch.device) -> str | None:
    """The UUID of a CUDA ``device`` (None for another device or where torch does not report it)."""
    if device.type != "cuda":
        return None
    return str(getattr(torch.cuda.get_device_properties(device), "uuid", "")) or None


def nccl_group(store, rank: int, world_size: int, timeout: timedelta) -> Any:
    """A ProcessGroupNCCL of ``world_size`` ranks on ``store`` (CUDA builds of torch only)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


class MegarlWeightReceiver:
    """Methods mixed into vLLM's worker class (names prefixed so they cannot clash with its own)."""

    def megarl_worker_device(self) -> dict:
        """One answer per worker: its device (vLLM's ``self.device``: "cpu", "cuda:0", ...), that
        GPU's UUID and this host's name; the trainer counts the answers and picks the backend
        from them (NCCL cannot put two ranks on one GPU, so it needs to know which GPU)."""
        device = torch.device(getattr(self, "device", "cpu"))
        return {"device": str(device), "gpu": gpu_uuid(device), "host": socket.gethostname()}

    def megarl_open_channel(self, channel: str) -> str:
        """Join the trainer's group: ``channel`` = JSON {host, port, world_size, timeout_s} and
        optionally ``backend`` ("gloo", the default, or "nccl": then on this worker's GPU)."""
        c = json.loads(channel)
        rank = 1 + int(getattr(self, "rank", 0))
        backend = c.get("backend", "gloo")
        if backend not in BACKENDS:
            raise ValueError(f"megarl_open_channel: backend must be gloo or nccl, got {backend!r}")
        device = torch.device(getattr(self, "device", "cpu"))
        if backend == "nccl" and device.type != "cuda":
            raise RuntimeError(
                f"megarl_open_channel: an NCCL channel needs a CUDA worker, this one is on {device}"
            )
        timeout = timedelta(seconds=float(c["timeout_s"]))
        store = dist.TCPStore(
            c["host"], int(c["port"]), int(c["world_size"]), is_master=False, timeout=timeout
        )
        if backend == "gloo":
            self._megarl_group = dist.ProcessGroupGloo(store, rank, int(c["world_size"]), timeout)
        else:
            with torch.cuda.device(device):
                # twice the trainer's deadline: its side aborts first on a stall
                group = nccl_group(store, rank, int(c["world_size"]), 2 * timeout)
                hello = torch.zeros(1, dtype=torch.int64, device=device)
                group.broadcast(hello, 0).wait()  # forms the communicator with the trainer now
                if int(hello.item()) != int(c["world_size"]):
                    raise RuntimeError(f"megarl_open_channel: bad NCCL hello {int(hello.item())}")
            self._megarl_group = group
            self._megarl_device = device
        self._megarl_backend = backend
        self._megarl_store = store
        # in the server's log: which channel a run's syncs use (benchmarks/gpu/check.py reads it)
        print(
            f"megarl_vllm_receiver: rank {rank} joined the trainer's {backend} channel on {device}",
            flush=True,
        )
        return f"rank {rank} joined ({backend})"

    def megarl_close_channel(self) -> str:
        """Leave the group (the trainer closes its side too)."""
        self._megarl_group = None
        self._megarl_store = None
        return "closed"

    def megarl_receive_weights(self) -> dict:
        """Receive one sync stream and reload its tensors in place; returns the buckets' checksums
        (``{"crc32": [...]}`` over gloo, ``{"digest": [...]}`` over NCCL)."""
        if getattr(self, "_megarl_group", None) is None:
            raise RuntimeError("megarl_receive_weights: no channel open (megarl_open_channel first)")
        if getattr(self, "_megarl_backend", "gloo") == "nccl":
            device = self._megarl_device
            digests: list[int] = []
            with torch.cuda.device(device):
                self.reload_weights(  # type: ignore[attr-defined]  (vLLM's worker method)
                    weights_iterator=receive_buckets_on_device(self._megarl_group, digests, device),
                    is_checkpoint_format=True,
                )
            return {"digest": digests}
        crcs: list[int] = []
        self.reload_weights(  # type: ignore[attr-defined]  (vLLM's worker method)
            weights_iterator=receive_buckets(self._megarl_group, crcs), is_checkpoint_format=True
        )
        return {"crc32": crcs}
