"""Tiny Qwen3 checkpoints with random weights, built locally for rollout tests and benchmarks.

Nothing comes from a model hub: the config and the (locally trained) tokenizer are copied from
``shared/fixtures/tiny-qwen3`` and the weights are drawn with ``torch.manual_seed(seed)``. As in
the recorded fixtures, ``lm_head.weight`` is re-drawn as N(0, ``lm_head_std``) so that sampling is
far from uniform and greedy decoding has clear winners (exact greedy comparisons across engines).
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


def find_tiny_qwen3_fixture() -> Path:
    """The ``tiny-qwen3`` fixture folder: $MEGARL_TINY_QWEN3, else ``shared/fixtures/tiny-qwen3``
    next to (or above) the repository root."""
    env = os.environ.get("MEGARL_TINY_QWEN3")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent / "shared" / "fixtures" / "tiny-qwen3"
        if cand.is_dir():
            return cand
        cand = parent.parent / "shared" / "fixtures" / "tiny-qwen3"
        if cand.is_dir():
            return cand
    raise FileNotFoundError(
        "tiny-qwen3 fixture not found: set MEGARL_TINY_QWEN3 "
        "or put shared/fixtures/tiny-qwen3 beside the repo"
    )


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
