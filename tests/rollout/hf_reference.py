"""Reference computations with plain transformers (the learner's view of the same weights)."""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=8)
def load_hf(model_dir: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()


@torch.no_grad()
def hf_greedy(model_dir: str, prompt: list[int], max_new_tokens: int, dtype: str = "float32") -> list[int]:
    """transformers ``generate`` greedy output, EOS not stopping generation (like ignore_eos)."""
    from transformers import GenerationConfig

    model = load_hf(str(model_dir), dtype)
    gc = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    out = model.generate(
        torch.tensor([prompt]),
        generation_config=gc,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()
