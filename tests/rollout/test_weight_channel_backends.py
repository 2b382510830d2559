"""The in-memory weight sync's backend choice (gloo for CPU workers, NCCL for CUDA ones) and what
can be checked of the NCCL path without a GPU: the refusal without CUDA, the device digest, and
the device stream's logic. The NCCL stream runs here over a real gloo group on CPU tensors (NCCL
itself needs a GPU; benchmarks/gpu/check.py runs it). The gloo wire format is checked byte for byte
against the stream as docs/rollout.md describes it."""

from __future__ import annotations

import json
import socket
import threading

import numpy as np
import pytest
import torch

import megarl.rollout.memory_sync as memory_sync
from megarl.rollout.memory_sync import (
    WeightChannel,
    backend_for_workers,
    choose_backend,
    plan_buckets,
    sglang_workers,
    stream_on_device,
)
from megarl.rollout.types import RolloutError
from megarl.rollout.vllm_ext.megarl_vllm_receiver import (
    DIGEST_CHUNK,
    DIGEST_MOD,
    MegarlWeightReceiver,
    SyncAborted,
    device_digest,
    fold_digests,
    receive_buckets_on_device,
)
from tests.rollout.test_weight_channel import _connected

CPU = torch.device("cpu")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "model.embed_tokens.weight": torch.randn(32, 8, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.flags": torch.tensor([1, 0, 1], dtype=torch.uint8),  # 3 bytes: an odd tail
        "lm_head.weight": torch.randn(32, 8, generator=g),
    }


@pytest.mark.parametrize(
    "devices, backend",
    [(["cpu"], "gloo"), (["cpu", "cpu"], "gloo"), (["cuda:0"], "nccl"), (["cuda:0", "cuda:1"], "nccl")],
)
def test_the_backend_follows_the_workers_device(devices, backend):
    assert backend_for_workers(devices) == backend


def test_workers_on_mixed_or_unknown_devices_are_refused():
    with pytest.raises(RolloutError, match=r"one device type expected"):
        backend_for_workers(["cpu", "cuda:0"])
    with pytest.raises(ValueError, match="no backend for a server on device 'xpu'"):
        backend_for_workers(["xpu:0"])


def _worker(device: str, gpu: str | None = None, host: str | None = None) -> dict:
    """One worker's ``megarl_worker_device`` answer."""
    return {"device": device, "gpu": gpu, "host": host or socket.gethostname()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_nccl_without_cuda_is_refused_naming_the_config_key():
    no_cuda = r"no CUDA device .*rollout\.weight_sync: disk"
    with pytest.raises(RolloutError, match=no_cuda):
        WeightChannel.host_store("127.0.0.1", world_size=2, backend="nccl")
    with pytest.raises(RolloutError, match=no_cuda):  # CUDA workers pick NCCL by themselves
        choose_backend([_worker("cuda:0", "GPU-1", "gpu-node")], "vllm@x")
    with pytest.raises(ValueError, match="backend must be gloo or nccl, got 'mpi'"):
        WeightChannel.host_store("127.0.0.1", world_size=2, backend="mpi")


def test_the_choice_follows_the_workers_and_what_is_asked_for():
    assert choose_backend([_worker("cpu"), _worker("cpu")], "vllm@x") == "gloo"
    # gloo asked for: CUDA is not touched, whatever the workers' device
    assert choose_backend([_worker("cuda:0", "GPU-1")], "vllm@x", requested="gloo") == "gloo"
    with pytest.raises(RolloutError, match=r"vllm@x: an NCCL weight channel needs CUDA workers.*\['cpu'\]"):
        choose_backend([_worker("cpu")], "vllm@x", requested="nccl")


def test_a_server_on_the_trainers_gpu_gets_gloo(monkeypatch):
    """NCCL cannot put two ranks on one GPU. This process's CUDA device and its UUID are stood in
    for (no GPU here): the choice compares them with the workers' answers."""
    monkeypatch.setattr(memory_sync, "sync_cuda_device", lambda what: torch.device("cuda", 0))
    monkeypatch.setattr(memory_sync, "gpu_uuid", lambda device: "GPU-mine")
    assert choose_backend([_worker("cuda:0", "GPU-other")], "vllm@x") == "nccl"
    assert choose_backend([_worker("cuda:0", "GPU-mine", "elsewhere")], "vllm@x") == "nccl"
    assert choose_backend([_worker("cuda:0", "GPU-other"), _worker("cuda:1", "GPU-mine")], "vllm@x") == "gloo"
    with pytest.raises(RolloutError, match="NCCL cannot put two ranks on one GPU"):
        choose_backend([_worker("cuda:0", "GPU-mine")], "vllm@x", requested="nccl")


def test_an_sglang_servers_ranks_are_seen_from_its_server_info(monkeypatch):
    """SGLang answers no GPU UUID: its ranks' GPUs come from ``base_gpu_id``/``gpu_id_step``, read
    with this process's device numbering when the server is on this host. CUDA and the UUIDs are
    stood in for (no GPU here)."""
    cpu = {"device": "cpu", "tp_size": 2}
    assert [w["device"] for w in sglang_workers(cpu, "http://127.0.0.1:30000")] == ["cpu", "cpu"]
    assert choose_backend(sglang_workers(cpu, "http://127.0.0.1:30000"), "sglang@x") == "gloo"

    monkeypatch.setattr(memory_sync.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory_sync.torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(memory_sync, "gpu_uuid", lambda device: f"GPU-{device.index}")
    monkeypatch.setattr(memory_sync, "sync_cuda_device", lambda what: torch.device("cuda", 0))
    cuda = {"device": "cuda", "tp_size": 2, "base_gpu_id": 1, "gpu_id_step": 2}
    local = sglang_workers(cuda, "http://localhost:30000")
    assert [(w["device"], w["gpu"], w["host"]) for w in local] == [
        ("cuda:1", "GPU-1", socket.gethostname()),
        ("cuda:3", "GPU-3", socket.gethostname()),
    ]
    assert choose_backend(local, "sglang@x") == "nccl"  # GPUs 1 and 3; this trainer is on 0
    shared = sglang_workers({**cuda, "base_gpu_id": 0}, f"http://{socket.gethostname()}:30000")
    assert choose_backend(shared, "sglang@x") == "gloo"  # rank 0 is on this trainer's GPU
    remote = sglang_workers({**cuda, "base_gpu_id": 0}, "http://gpu-node-7:30000")
    assert [w["gpu"] for w in remote] == [None, None] and remote[0]["host"] == "gpu-node-7"
    assert choose_backend(remote, "sglang@x") == "nccl"


def test_an_sglang_engine_refuses_an_unknown_backend():
    from megarl.rollout.sglang_client import SGLangEngine

    with pytest.raises(ValueError, match="weight_sync_backend must be None, 'gloo' or 'nccl', got 'mpi'"):
        SGLangEngine("http://127.0.0.1:1", weight_sync_backend="mpi")


def test_a_cpu_worker_refuses_an_nccl_invitation_and_reports_its_device():
    worker = MegarlWeightReceiver()
    assert worker.megarl_worker_device() == {"device": "cpu", "gpu": None, "host": socket.gethostname()}
    invitation = json.dumps(
        {"host": "127.0.0.1", "port": 1, "world_size": 2, "timeout_s": 1, "backend": "nccl"}
    )
    with pytest.raises(RuntimeError, match="NCCL channel needs a CUDA worker, this one is on cpu"):
        worker.megarl_open_channel(invitation)


def _reference_digest(t: torch.Tensor) -> tuple[int, int]:
    """The digest as its docstring defines it, in numpy (int16 words, odd tail byte a word)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    words = raw[: len(raw) - len(raw) % 2].view("<i2").astype(np.int64).tolist()
    if len(raw) % 2:
        words.append(int(raw[-1]))
    pos = [(i % DIGEST_MOD) + 1 for i in range(len(words))]
    return sum(words), sum(w * p for w, p in zip(words, pos))


def test_device_digest_matches_its_definition_and_sees_changes_and_moves():
    g = torch.Generator().manual_seed(2)
    for t in (torch.randn(7, 5, generator=g), torch.randint(0, 255, (11,), dtype=torch.uint8, generator=g)):
        assert tuple(device_digest(t).tolist()) == _reference_digest(t)
    # more words than one chunk: the weights restart every DIGEST_MOD words across chunks
    big = torch.randint(-(2**15), 2**15, (DIGEST_CHUNK + 3 * DIGEST_MOD + 5,), dtype=torch.int16, generator=g)
    w = big.to(torch.int64).numpy()
    pos = np.arange(w.size, dtype=np.int64) % DIGEST_MOD + 1
    assert device_digest(big).tolist() == [int(w.sum()), int((w * pos).sum())]
    t = torch.randn(64, generator=g)
    base = device_digest(t)
    flipped = t.clone()
    flipped.view(torch.uint8)[100] ^= 1
    swapped = t.clone()
    swapped[[3, 40]] = t[[40, 3]]
    assert not torch.equal(device_digest(flipped), base)
    assert not torch.equal(device_digest(swapped), base)
    assert fold_digests([[1, 2], [3, 4]]) != fold_digests([[3, 4], [1, 2]])


class _Recorder:
    """Stands in for the process group to record what the channel broadcasts (bytes, in order)."""

    def __init__(self):
        self.messages: list[bytes] = []

    def broadcast(self, t: torch.Tensor, root: int):
        assert root == 0 and t.device.type == "cpu"
        self.messages.append(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return self

    def wait(self):
        return True


def test_the_gloo_stream_and_invitation_are_the_documented_bytes():
    state = _state()
    channel = WeightChannel.host_store("127.0.0.1", world_size=2, timeout_s=5)
    assert json.loads(channel.invitation()).keys() == {"host", "port", "world_size", "timeout_s"}
    assert channel.checksum_key == "crc32"
    channel.group = rec = _Recorder()
    buckets = plan_buckets(state, bucket_bytes=600)
    channel.send(buckets)
    expected = []
    for bucket in buckets:  # int64 header length, JSON header, each tensor's bytes; then 0
        header = json.dumps(
            [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in bucket.items()]
        ).encode()
        expected += [np.int64(len(header)).tobytes(), header]
        expected += [t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in bucket.values()]
    expected.append(np.int64(0).tobytes())
    assert rec.messages == expected


def test_the_device_stream_arrives_bit_exact_with_matching_digests_and_aborts():
    """The NCCL path's send and receive code, run over a gloo group with every message on CPU."""
    channel, worker = _connected()
    group = worker._megarl_group  # type: ignore[attr-defined]
    state = _state()
    got: dict[str, torch.Tensor] = {}
    digests: list[int] = []

    def receive(out: dict):
        try:
            for name, t in receive_buckets_on_device(group, digests, CPU):
                got[name] = t.clone()
        except Exception as e:
            out["error"] = e

    out: dict = {}
    t = threading.Thread(target=receive, args=(out,))
    t.start()
    sent = stream_on_device(channel._broadcast, plan_buckets(state, 600), CPU, lambda x: x.tolist())
    t.join(timeout=30)
    assert "error" not in out and len(sent) == 3 and digests == sent
    assert list(got) == list(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)

    def failing():
        yield {"lm_head.weight": state["lm_head.weight"]}
        raise RuntimeError("gather failed")

    out = {}
    t = threading.Thread(target=receive, args=(out,))
    t.start()
    with pytest.raises(RuntimeError, match="gather failed"):
        stream_on_device(channel._broadcast, failing(), CPU, lambda x: x.tolist())
    t.join(timeout=30)
    assert isinstance(out.get("error"), SyncAborted)
