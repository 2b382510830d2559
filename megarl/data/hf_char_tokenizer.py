"""The character tokenizer as a Hugging Face tokenizer (tokenizer.json + tokenizer_config.json), so
that servers which load a tokenizer (vLLM) can serve a model built in the run. Same ids as
``CharTokenizer``: 0 ``<pad>``, 1 ``<eos>``, 2 ``<bos>``, one id per character, unused padding ids."""

from __future__ import annotations

import os
from pathlib import Path

from megarl.data.tokenizer import CharTokenizer


def save_hf_char_tokenizer(tok: CharTokenizer, out_dir: str | os.PathLike) -> Path:
    """Write ``tok`` as a fast HF tokenizer into ``out_dir`` (which may hold a checkpoint already)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for c in tok.alphabet:
        vocab[c] = len(vocab)
    while len(vocab) < tok.vocab_size:
        vocab[f"<unused_{len(vocab)}>"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    fast.save_pretrained(str(out_dir))
    return Path(out_dir)
