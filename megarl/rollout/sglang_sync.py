"""Trainer side of the in-memory weight sync to an SGLang server (no checkpoint on disk).

SGLang receives weights itself: ``/init_weights_update_group`` makes every TP rank of the server
join a torch.distributed group with the trainer (rank 0, which hosts the TCP store; server TP rank
``r`` is rank ``1 + r``), and each ``/update_weights_from_distributed`` call announces one bucket
(names, dtypes, shapes) and receives its tensors by broadcast from rank 0, one broadcast per tensor
in the announced order, then loads them in place. Calls go between ``/begin_weight_update`` and
``/end_weight_update``.

SGLang builds its end of the group with torch's ``_new_process_group_helper`` under a store
prefixed by the group name three times (``<name>/``, ``<name>//``, ``<device>/``) and then sets the
group's sequence number from rank 0; ``GroupChannel.join`` builds the same layout with public torch
classes. The backend follows the server's device: gloo for a CPU server (the tensors travel over
TCP), NCCL for a CUDA one (the tensors are moved to this process's current CUDA device first).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.rollout.vllm_ext.megarl_vllm_receiver import byte_view, crc32

GROUP_NAME = "megarl_weights"
Bucket = dict[str, torch.Tensor]


def backend_for_device(device: str) -> str:
    """The collective backend for a server on ``device`` ("cpu" -> gloo, "cuda" -> nccl)."""
    if device == "cpu":
        return "gloo"
    if device == "cuda":
        return "nccl"
    raise ValueError(f"in-memory weight sync: no backend for a server on device {device!r} (cpu or cuda)")


def bucket_meta(bucket: Bucket) -> dict[str, list]:
    """The ``names``/``dtypes``/``shapes`` fields of one ``/update_weights_from_distributed`` call."""
    return {
        "names": list(bucket),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in bucket.values()],
        "shapes": [list(t.shape) for t in bucket.values()],
    }


@dataclass
class GroupChannel:
    """Rank 0 of the group SGLang's ``/init_weights_update_group`` joins: the store it hosts and,
    once joined, the process group."""

    host: str
    port: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float
    store: dist.TCPStore
    group: object | None = None

    @classmethod
    def host_store(
        cls,
        host: str,
        world_size: int,
        *,
        group_name: str = GROUP_NAME,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> GroupChannel:
        """Open the store on a free port of ``host`` (the server's ranks connect to it)."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"in-memory weight sync: backend must be gloo or nccl, got {backend!r}")
        store = dist.TCPStore(
            host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        # one name per channel: SGLang refuses a second group under a name it already holds
        # (another client of the same server, or a trainer restarted against it)
        name = f"{group_name}_{uuid.uuid4().hex[:12]}"
        return cls(host, store.port, world_size, name, backend, timeout_s, store)

    def invitation(self) -> dict:
        """The body of ``/init_weights_update_group``."""
        return {
            "master_address": self.host,
            "master_port": self.port,
            "rank_offset": 1,
            "world_size": self.world_size,
            "group_name": self.group_name,
            "backend": self.backend,
        }

    def join(self) -> None:
        """Join as rank 0 (blocks until every server rank has joined)."""
        device = "cpu" if self.backend == "gloo" else "cuda"
        name = self.group_name
        prefixed = dist.PrefixStore(
            f"{device}/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, self.store))
        )
        timeout = timedelta(seconds=self.timeout_s)
        if self.backend == "gloo":
            group = dist.ProcessGroupGloo(prefixed, 0, self.world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, 0, self.world_size, options)
        group._set_sequence_number_for_group()  # the server's ranks wait for rank 0's number
        self.group = group

    def send_bucket(self, bucket: Bucket, digests: EngineDigests | None = None) -> int:
        """Broadcast the bucket's tensors in order (and account for each in ``digests``);
        returns the CRC-32 of their bytes."""
        if self.group is None:
            raise RuntimeError("weight channel: send before join")
        value = 0
        for name, t in bucket.items():
            host = t.detach().to("cpu").contiguous()
            value = crc32(byte_view(host), value)
            if digests is not None:
                digests.add(name, host)
            wire = host if self.backend == "gloo" else host.to(torch.cuda.current_device())
            self.group.broadcast(wire, 0).wait()  # type: ignore[attr-defined]
        return value


# SGLang stores these HF tensors concatenated along dim 0, in this order, under one name
FUSED = {"q_proj": ("qkv_proj", 3, 0), "k_proj": ("qkv_proj", 3, 1), "v_proj": ("qkv_proj", 3, 2)}
FUSED |= {"gate_proj": ("gate_up_proj", 2, 0), "up_proj": ("gate_up_proj", 2, 1)}


# SGLang's vocabulary-parallel tensors have their rows padded to a multiple of this, with zeros
VOCAB_PADDING = 64
VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight")


def engine_name(hf_name: str) -> tuple[str, int, int]:
    """SGLang's parameter name for an HF tensor, with the number of parts fused into it and this
    tensor's place among them (``(hf_name, 1, 0)`` when it is stored as is)."""
    parts = hf_name.split(".")
    for i, p in enumerate(parts):
        if p in FUSED:
            fused, n, k = FUSED[p]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), n, k
    return hf_name, 1, 0


class EngineDigests:
    """What SGLang's ``/weights_checker`` (action "checksum") should answer for the tensors sent:
    per parameter the first 8 bytes of the SHA-256 of its bytes in the server's dtype, fused
    parameters over their parts' bytes in order, the embedding and output layer with their rows
    padded with zeros to a multiple of 64 as SGLang stores them (the CPU engine's hash at TP 1;
    its GPU hash differs). Parts of a fused parameter wait here until all have arrived."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.digests: dict[str, str] = {}
        self._parts: dict[str, dict[int, bytes]] = {}

    @staticmethod
    def _hex(chunks: Iterable[bytes]) -> str:
        h = hashlib.sha256()
        for c in chunks:
            h.update(c)
        return f"{int.from_bytes(h.digest()[:8], 'big'):016x}"

    def add(self, hf_name: str, t: torch.Tensor) -> None:
        """Account for one tensor as sent."""
        host = t.detach().to("cpu", self.dtype).contiguous()
        raw = byte_view(host).numpy().tobytes()
        name, n, k = engine_name(hf_name)
        if n == 1:
            pad = b""
            if name.endswith(VOCAB_PARALLEL) and host.dim() == 2:
                rows = -host.shape[0] % VOCAB_PADDING
                pad = bytes(rows * host.shape[1] * host.element_size())
            self.digests[name] = self._hex([raw, pad])
            return
        parts = self._parts.setdefault(name, {})
        parts[k] = raw
        if len(parts) == n:
            self.digests[name] = self._hex(parts[i] for i in range(n))
            del self._parts[name]

    def compare(self, engine: dict[str, str]) -> tuple[int, list[str]]:
        """(parameters checked, names whose digest differs) against the engine's checksums;
        parameters only one side has are not checked."""
        both = [n for n in self.digests if n in engine]
        return len(both), [n for n in both if engine[n] != self.digests[n]]
