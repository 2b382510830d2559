"""Tiny Qwen3-MoE HF checkpoints for the fault tests: an original (random weights, built with
transformers) and a hand-made proxy keeping some of its routed experts bit-exactly."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ALPHABET = "0123456789+=RC "
VOCAB = 24  # CharTokenizer(ALPHABET): 3 specials + 15 characters, padded to a multiple of 8


def make_moe_dir(out: Path, experts: int = 8, topk: int = 2, layers: int = 2, seed: int = 0) -> Path:
    """A random-weight Qwen3-MoE written by ``save_pretrained`` (per-expert tensor names)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=experts,
        num_experts_per_tok=topk,
        norm_topk_prob=True,
        max_position_embeddings=64,
        router_aux_loss_coef=0.01,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    save_char_tokenizer(Path(out))
    return Path(out)


def save_char_tokenizer(out: Path) -> Path:
    """The char tokenizer (megarl.data.tokenizer.CharTokenizer over ALPHABET) as a HF fast
    tokenizer with the same ids, so ``megarl proxy prune`` can tokenize calibration text."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megarl.data.tokenizer import CharTokenizer

    ct = CharTokenizer(ALPHABET)
    vocab = {"<pad>": ct.pad_id, "<eos>": ct.eos_id, "<bos>": ct.bos_id}
    vocab.update({c: ct.encode(c, bos=False)[0] for c in ALPHABET})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>"
    ).save_pretrained(out)
    return Path(out)


def slice_experts(src: Path, dst: Path, keep: list[int]) -> Path:
    """A proxy by hand: experts ``keep`` of every MoE layer copied bit-exactly, renumbered 0..E'-1,
    router rows sliced the same way, everything else untouched; config rewritten."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        state.update(load_file(str(f)))
    out = {}
    for k, v in state.items():
        if ".mlp.experts." in k:
            head, rest = k.split(".mlp.experts.")
            e, tail = rest.split(".", 1)
            if int(e) in keep:
                out[f"{head}.mlp.experts.{keep.index(int(e))}.{tail}"] = v.clone()
        elif k.endswith(".mlp.gate.weight"):
            out[k] = v[keep].clone()
        else:
            out[k] = v
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg["num_experts"] = len(keep)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst
