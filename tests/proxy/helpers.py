"""Tiny random-weight MoE checkpoints (Qwen3-MoE, DeepSeek-V3, Mixtral) with the tiny-qwen3
fixture's real tokenizer, and calibration text, for the proxy tests."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from megarl.testing.tiny_qwen3 import find_tiny_qwen3_fixture

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")
VOCAB = 1024  # the fixture tokenizer's vocabulary

CALIB_TEXTS = [
    "user: What is 2+2?\nassistant: 4",
    "Reverse the digits 12345 to get 54321.",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b",
    "Mixture-of-experts layers route each token to a few experts.",
    "A proxy model keeps the backbone and prunes routed experts.",
    "user: Name three primes.\nassistant: 2, 3, 5",
    "Loss spikes and gradient overflow are reproduced on the proxy.",
] * 6


def tiny_moe_config(
    arch: str = "qwen3_moe", num_experts: int = 8, top_k: int = 2, layers: int = 2, **kw
) -> dict:
    """transformers config kwargs of a tiny MoE of ``arch``."""
    base = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    if arch == "qwen3_moe":
        base.update(
            intermediate_size=128,
            num_key_value_heads=2,
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=True,
            router_aux_loss_coef=0.0,
        )
    elif arch == "deepseek_v3":
        base.update(
            intermediate_size=128,
            moe_intermediate_size=32,
            num_key_value_heads=4,
            n_routed_experts=num_experts,
            n_shared_experts=1,
            num_experts_per_tok=top_k,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            norm_topk_prob=True,
        )
    elif arch == "mixtral":
        base.update(
            intermediate_size=32,
            num_key_value_heads=2,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
        )
    else:
        raise ValueError(arch)
    base.update(kw)
    return base


def build_tiny_moe(
    out_dir: str | os.PathLike, arch: str = "qwen3_moe", seed: int = 0, with_tokenizer: bool = True, **cfg_kw
) -> Path:
    """Save a random tiny MoE (float32 safetensors) + the fixture tokenizer to ``out_dir``."""
    import transformers

    cls = {
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    }[arch]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls[0])(**tiny_moe_config(arch, **cfg_kw))
    model = getattr(transformers, cls[1])(cfg).float().eval()
    with torch.no_grad():  # routers start at zero in some inits: give them real spread
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            if name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    out = Path(out_dir)
    model.save_pretrained(out)
    if with_tokenizer:
        fx = find_tiny_qwen3_fixture()
        for f in TOKENIZER_FILES:
            if (fx / f).exists():
                shutil.copyfile(fx / f, out / f)
                os.chmod(out / f, 0o644)
    return out


def write_calib(path: str | os.PathLike, texts: list[str] | None = None) -> Path:
    """A .jsonl calibration file with a ``text`` field per row."""
    p = Path(path)
    p.write_text("".join(json.dumps({"text": t}) + "\n" for t in (texts or CALIB_TEXTS)))
    return p


def dir_digest(d: str | os.PathLike) -> str:
    """sha256 over every file's relative path, bytes and mode (detects any change to a directory)."""
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(d)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(os.path.relpath(p, d).encode())
            h.update(oct(os.stat(p).st_mode).encode())
            with open(p, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()
