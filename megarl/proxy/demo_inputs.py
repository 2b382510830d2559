"""``megarl proxy demo-inputs OUT_DIR``: the inputs of the docs/proxy.md walk-through.

Writes, with nothing downloaded:

- ``OUT_DIR/tiny-moe/``: a random-weight Qwen3-MoE HF checkpoint (8 routed experts, top-2, 2 layers,
  hidden 64, float32 safetensors) whose tokenizer is megarl's char tokenizer over the 3-digit task
  alphabet, saved as a HF fast tokenizer with the same ids, so the checkpoint runs the fault recipe
  ``tests/faults/recipe.yaml`` (``model.tokenizer: char``) and ``megarl proxy prune`` can tokenize
  calibration text with it;
- ``OUT_DIR/calib.jsonl``: the recipe's training prompts with their answers, one
  ``{"text": prompt + answer}`` row each (the reverse task, 3 digits, 200 rows, seed 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ALPHABET = "0123456789+=RC "  # the fault recipe's and the quickstart's model.alphabet


def write_char_tokenizer(out_dir: str | os.PathLike, alphabet: str = ALPHABET) -> Path:
    """Save ``CharTokenizer(alphabet)`` as a HF fast tokenizer (same ids, one token per character)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megarl.data.tokenizer import CharTokenizer

    ct = CharTokenizer(alphabet)
    vocab = {"<pad>": ct.pad_id, "<eos>": ct.eos_id, "<bos>": ct.bos_id}
    vocab.update({c: ct.encode(c, bos=False)[0] for c in alphabet})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>"
    )
    fast.save_pretrained(str(out_dir))
    return Path(out_dir)


def write_tiny_moe(
    out_dir: str | os.PathLike, experts: int = 8, top_k: int = 2, layers: int = 2, seed: int = 0
) -> Path:
    """A random-weight Qwen3-MoE HF checkpoint with the char tokenizer in ``out_dir`` (created)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from megarl.data.tokenizer import CharTokenizer

    ct = CharTokenizer(ALPHABET)
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=ct.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        max_position_embeddings=64,
        router_aux_loss_coef=0.01,
        tie_word_embeddings=False,
        bos_token_id=ct.bos_id,
        eos_token_id=ct.eos_id,
        pad_token_id=ct.pad_id,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(out_dir))
    write_char_tokenizer(out_dir)
    return Path(out_dir)


def write_calibration(path: str | os.PathLike, rows: int = 200, digits: int = 3, seed: int = 0) -> Path:
    """The reverse task's training rows (as the fault recipe generates them) as ``{"text": ...}``."""
    from megarl.data.tasks import generate_task_files

    with tempfile.TemporaryDirectory() as tmp:
        train = Path(tmp) / "train.jsonl"
        generate_task_files("reverse", train, Path(tmp) / "eval.jsonl", rows, 8, digits, seed)
        texts = [r["prompt"] + r["answer"] for r in map(json.loads, train.read_text().splitlines())]
    p = Path(path)
    p.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return p


def main(argv: list[str] | None = None) -> int:
    """``megarl proxy demo-inputs OUT_DIR``; exit 2 when OUT_DIR/tiny-moe or calib.jsonl exists."""
    ap = argparse.ArgumentParser(
        prog="megarl proxy demo-inputs",
        description="Write the docs/proxy.md walk-through's inputs: OUT_DIR/tiny-moe (a random-weight "
        "Qwen3-MoE with the char tokenizer) and OUT_DIR/calib.jsonl (calibration text).",
    )
    ap.add_argument("out_dir", help="directory to write into (created; existing outputs are not overwritten)")
    ap.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    a = ap.parse_args(argv)
    out = Path(a.out_dir)
    model, calib = out / "tiny-moe", out / "calib.jsonl"
    for p in (model, calib):
        if p.exists():
            print(f"megarl proxy demo-inputs: {p} exists; remove it or pick another OUT_DIR", file=sys.stderr)
            return 2
    if a.experts < 2:
        print(
            f"megarl proxy demo-inputs: --experts {a.experts}: need at least 2 (top-2 routing)",
            file=sys.stderr,
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)
    write_tiny_moe(model, experts=a.experts, seed=a.seed)
    write_calibration(calib)
    print(f"wrote {model} (Qwen3-MoE, {a.experts} experts, top-2, random weights, char tokenizer)")
    print(f"wrote {calib} (200 rows of the fault recipe's reverse task)")
    return 0
