"""The trainer's expectation of SGLang's per-parameter checksums after an in-memory sync
(megarl/rollout/sglang_sync.py): HF names map to SGLang's fused parameters, and a fused digest is
the SHA-256 of its parts' bytes concatenated in SGLang's order, in the server's dtype, whatever
order the parts arrive in. Against a live server in tests/rollout/test_sglang_live.py."""

from __future__ import annotations

import hashlib

import torch

from megarl.rollout.sglang_sync import EngineDigests, backend_for_device, bucket_meta, engine_name


def sha64(t: torch.Tensor) -> str:
    return f"{int.from_bytes(hashlib.sha256(t.contiguous().numpy().tobytes()).digest()[:8], 'big'):016x}"


def test_engine_names():
    assert engine_name("model.layers.3.self_attn.k_proj.weight") == (
        "model.layers.3.self_attn.qkv_proj.weight",
        3,
        1,
    )
    assert engine_name("model.layers.0.self_attn.q_proj.bias") == (
        "model.layers.0.self_attn.qkv_proj.bias",
        3,
        0,
    )
    assert engine_name("model.layers.1.mlp.up_proj.weight") == (
        "model.layers.1.mlp.gate_up_proj.weight",
        2,
        1,
    )
    assert engine_name("model.layers.1.self_attn.o_proj.weight") == (
        "model.layers.1.self_attn.o_proj.weight",
        1,
        0,
    )


def test_fused_digest_is_the_concatenation_in_sglang_order_in_the_server_dtype():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 8, generator=g).to(torch.bfloat16) for n in (8, 4, 4))
    norm = torch.randn(8, generator=g)
    d = EngineDigests(torch.float32)
    p = "model.layers.0.self_attn."
    for name, t in ((p + "v_proj.weight", v), (p + "q_proj.weight", q), (p + "q_norm.weight", norm)):
        d.add(name, t)
    assert p + "qkv_proj.weight" not in d.digests  # k has not arrived
    d.add(p + "k_proj.weight", k)
    assert d.digests[p + "qkv_proj.weight"] == sha64(torch.cat([q, k, v]).float())
    assert d.digests[p + "q_norm.weight"] == sha64(norm)
    engine = {
        p + "qkv_proj.weight": d.digests[p + "qkv_proj.weight"],
        p + "q_norm.weight": "0" * 16,
        "x": "1",
    }
    assert d.compare(engine) == (2, [p + "q_norm.weight"])


def test_bucket_meta_and_backend():
    b = {"a": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.zeros(4)}
    assert bucket_meta(b) == {"names": ["a", "b"], "dtypes": ["bfloat16", "float32"], "shapes": [[2, 3], [4]]}
    assert backend_for_device("cpu") == "gloo" and backend_for_device("cuda") == "nccl"


def test_vocabulary_rows_are_padded_with_zeros_as_sglang_stores_them():
    """SGLang pads the embedding's and output layer's rows to a multiple of 64 with zeros: a
    vocabulary of 24 (the quickstart's) is hashed as 64 rows (seen failing live: the trainer's
    unpadded digests differed for exactly these two parameters)."""
    emb = torch.randn(24, 4)
    d = EngineDigests(torch.float32)
    d.add("model.embed_tokens.weight", emb)
    d.add("lm_head.weight", emb[:, :3])
    d.add("model.norm.weight", torch.ones(24))
    assert d.digests["model.embed_tokens.weight"] == sha64(torch.cat([emb, torch.zeros(40, 4)]))
    assert d.digests["lm_head.weight"] == sha64(torch.cat([emb[:, :3], torch.zeros(40, 3)]))
    assert d.digests["model.norm.weight"] == sha64(torch.ones(24))
    full = torch.randn(128, 4)
    d.add("model.embed_tokens.weight", full)
    assert d.digests["model.embed_tokens.weight"] == sha64(full)
