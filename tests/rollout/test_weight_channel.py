"""The in-memory weight-sync stream between the trainer's channel and the receiver that runs in a
vLLM worker, both ends real (a gloo group over loopback, the receiver's code in a thread of this
process); only vLLM's in-place reload is replaced by collecting what the receiver yields."""

from __future__ import annotations

import threading

import pytest
import torch

from megarl.rollout.memory_sync import WeightChannel, bucket_header, plan_buckets
from megarl.rollout.vllm_ext.megarl_vllm_receiver import MegarlWeightReceiver, SyncAborted


class CollectingWorker(MegarlWeightReceiver):
    """A receiver whose reload keeps the tensors it is fed (vLLM's reload_weights consumes the
    same iterator)."""

    rank = 0

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        self.loaded = {name: t.clone() for name, t in weights_iterator}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(32, 8, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(8),
        "lm_head.weight": torch.randn(32, 8, generator=g),
    }


def _connected() -> tuple[WeightChannel, CollectingWorker]:
    channel = WeightChannel.host_store("127.0.0.1", world_size=2, timeout_s=30)
    worker = CollectingWorker()
    t = threading.Thread(target=worker.megarl_open_channel, args=(channel.invitation(),))
    t.start()
    channel.join()
    t.join()
    return channel, worker


def _receive(worker: CollectingWorker, out: dict) -> threading.Thread:
    def go():
        try:
            out["result"] = worker.megarl_receive_weights()
        except Exception as e:  # reported to the test
            out["error"] = e

    t = threading.Thread(target=go)
    t.start()
    return t


def test_buckets_keep_order_and_headers_name_dtype_and_shape():
    state = {
        "a": torch.arange(6, dtype=torch.float32).view(2, 3),
        "b": torch.ones(5, dtype=torch.bfloat16),
        "c": torch.arange(3, dtype=torch.int64),
    }
    buckets = plan_buckets(state, bucket_bytes=40)  # 24 + 10 bytes fit, + 24 more do not
    assert [list(b) for b in buckets] == [["a", "b"], ["c"]]
    assert b'"bfloat16"' in bucket_header(buckets[0]) and b"[2, 3]" in bucket_header(buckets[0])


def test_a_stream_arrives_bit_exact_with_matching_checksums_twice_on_one_channel():
    channel, worker = _connected()
    for scale in (1.0, -2.0):  # the channel stays open across syncs
        state = {k: v * scale for k, v in _state().items()}
        out: dict = {}
        t = _receive(worker, out)
        sent = channel.send(plan_buckets(state, bucket_bytes=600))
        t.join()
        assert "error" not in out
        assert out["result"]["crc32"] == sent and len(sent) == 3
        assert list(worker.loaded) == list(state)
        for k, v in state.items():
            assert worker.loaded[k].dtype == v.dtype and torch.equal(worker.loaded[k], v)


def test_a_failure_while_producing_buckets_aborts_the_receiver():
    channel, worker = _connected()
    state = _state()

    def buckets():
        yield {"model.norm.weight": state["model.norm.weight"]}
        raise RuntimeError("gather failed")

    out: dict = {}
    t = _receive(worker, out)
    with pytest.raises(RuntimeError, match="gather failed"):
        channel.send(buckets())
    t.join(timeout=30)
    assert isinstance(out.get("error"), SyncAborted)
