"""A run's tokenizer, model config and prompt datasets, from the config (before any process group)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from megarl.data.dataset import PromptDataset, load_jsonl_rows
from megarl.data.tokenizer import CharTokenizer
from megarl.trainer.config import ConfigError, TrainConfig

DEFAULT_CONTEXT = 4096  # the learner's max_position_embeddings when the HF config has none


_WRITER: Callable[[str], None] | None = None  # set while a progress bar is drawn in place


def set_log_writer(writer: Callable[[str], None] | None) -> None:
    """Route ``log`` through ``writer`` (a progress bar's ``write``, which prints above the bar);
    None: plain ``print`` again."""
    global _WRITER
    _WRITER = writer


def log(msg: str) -> None:
    """Print on rank 0 (or before the process group exists)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        if _WRITER is not None:
            _WRITER(msg)
        else:
            print(msg, flush=True)


class HFTokenizer:
    """A transformers tokenizer behind the CharTokenizer interface (encode/decode/eos_id)."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_id = tok.eos_token_id
        self.pad_id = tok.pad_token_id
        self.unk_id = tok.unk_token_id  # None for byte-level tokenizers (every text encodes)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids of ``text`` (special tokens when ``bos``)."""
        return self.tok.encode(text, add_special_tokens=bos)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` up to the first EOS."""
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tok.decode(ids, skip_special_tokens=True)


def model_hf_config(cfg: TrainConfig) -> dict:
    """The policy's HF config as the model section gives it (``hf_dir``'s config.json or ``hf_config``)."""
    if cfg.model.hf_dir is not None:
        from megarl.learner.model import load_hf_config

        return load_hf_config(cfg.model.hf_dir)
    return dict(cfg.model.hf_config)


def tokenizer_and_hf_config(cfg: TrainConfig) -> tuple[Any, dict]:
    """The tokenizer and the policy's HF config (special token ids from the char tokenizer)."""
    m = cfg.model
    hf = model_hf_config(cfg)
    if m.tokenizer == "char":
        tok = CharTokenizer(m.alphabet)
        if hf.get("vocab_size", tok.vocab_size) < tok.vocab_size:
            raise ConfigError(
                f"model.hf_config.vocab_size={hf['vocab_size']} is smaller than the char "
                f"tokenizer's {tok.vocab_size}"
            )
        hf.setdefault("vocab_size", tok.vocab_size)
        hf.update(eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id)
        return tok, hf
    if m.hf_dir is None:
        raise ConfigError("model.tokenizer='hf' needs model.hf_dir (a tokenizer.json beside the weights)")
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(m.hf_dir)), hf


def load_datasets(
    cfg: TrainConfig, tok: Any, hf_config: dict | None = None
) -> tuple[PromptDataset, PromptDataset | None]:
    """The train and eval prompt datasets (generated first when ``data.generate`` asks). A prompt that
    fills the context window of ``hf_config`` (default: the model section's) or an answer the
    tokenizer cannot encode is a bad row named by file:line."""
    d = cfg.data
    hf = model_hf_config(cfg) if hf_config is None else hf_config
    context_len = int(hf.get("max_position_embeddings") or DEFAULT_CONTEXT)
    if d.generate:
        from megarl.data.tasks import generate_task_files

        if not d.train or not d.eval:
            raise ConfigError("data.generate needs data.train and data.eval (the files it writes)")
        if not (os.path.exists(d.train) and os.path.exists(d.eval)):
            try:
                generate_task_files(train_path=d.train, eval_path=d.eval, **dict(d.generate))
            except (TypeError, ValueError) as e:
                raise ConfigError(
                    f"data.generate: {e}; allowed keys: task, num_train, num_eval, digits, seed"
                ) from None
    chat = None
    if d.chat_template:
        from megarl.data.chat import chat_renderer

        chat = chat_renderer(tok, d.system_prompt)

    def check(text: str) -> list[int]:
        return tok.encode(text)  # raises ValueError on an unknown character

    def check_answer(text: str) -> None:
        ids = tok.encode(text, bos=False)
        unk = getattr(tok, "unk_id", None)
        if unk is not None and unk in ids:
            raise ValueError(f"{text!r} holds text the tokenizer maps to its unknown token")

    def load(path: str) -> PromptDataset:
        rows, bad = load_jsonl_rows(
            path,
            d.prompt_field,
            d.answer_field,
            d.task_field,
            d.prompt_template,
            check,
            d.on_bad_row,
            d.max_bad_rows,
            chat=chat,
            check_answer=check_answer,
            context_len=context_len,
        )
        for b in bad[:5]:
            log(f"megarl train: skipped bad row {b}")
        if bad:
            log(f"megarl train: skipped {len(bad)} bad row(s) in {path}")
        return PromptDataset(rows, bad)

    return load(d.train), (load(d.eval) if d.eval else None)
