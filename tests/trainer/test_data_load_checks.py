"""Rows the run could not use are refused when the data is loaded, named by file:line: a prompt that
leaves the model's context window no room for a response, an answer the tokenizer cannot encode."""

import json
from pathlib import Path

import pytest
import yaml

from megarl.data.dataset import DataError
from megarl.trainer.config import from_dict
from megarl.trainer.setup import load_datasets, tokenizer_and_hf_config

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart.yaml"
GOOD = {"prompt": "R 123=", "answer": "321"}


def _setup(tmp_path, bad: dict, context: int = 16, on_bad_row: str = "fatal"):
    """A quickstart config over a 3-row train file whose row 2 is ``bad``; (cfg, tokenizer, hf, path)."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (GOOD, bad, GOOD)))
    d = yaml.safe_load(QUICKSTART.read_text())
    d["data"] = {"train": str(path), "on_bad_row": on_bad_row}
    d["model"]["hf_config"]["max_position_embeddings"] = context
    cfg = from_dict(d)
    tok, hf = tokenizer_and_hf_config(cfg)
    return cfg, tok, hf, path


def test_prompt_longer_than_the_context_window_is_refused_at_load(tmp_path):
    # "R 1234567890123=" is 16 characters + <bos> = 17 tokens; the window is 16
    cfg, tok, hf, path = _setup(tmp_path, {"prompt": "R 1234567890123=", "answer": "1"})
    want = (
        f"{path}:2: prompt is 17 tokens; the model's context window (max_position_embeddings) is 16 "
        "tokens, which leaves no room for a response"
    )
    with pytest.raises(DataError, match=want.replace("(", "\\(").replace(")", "\\)")):
        load_datasets(cfg, tok, hf)
    with pytest.raises(DataError, match=f"{path}:2: prompt is 17 tokens"):
        load_datasets(cfg, tok)  # without the HF config: read from the model section


def test_prompt_that_fills_the_window_exactly_is_refused_and_one_shorter_is_kept(tmp_path):
    cfg, tok, hf, path = _setup(tmp_path, {"prompt": "R 12345=", "answer": "1"}, context=9)
    with pytest.raises(DataError, match=f"{path}:2: prompt is 9 tokens"):
        load_datasets(cfg, tok, hf)
    cfg, tok, hf, path = _setup(tmp_path, {"prompt": "R 1234=", "answer": "1"}, context=9)
    train, _ = load_datasets(cfg, tok, hf)
    assert len(train) == 3


def test_answer_the_tokenizer_cannot_encode_is_refused_at_load(tmp_path):
    cfg, tok, hf, path = _setup(tmp_path, {"prompt": "R 12=", "answer": "2x"})
    with pytest.raises(DataError, match=f"{path}:2: answer cannot be tokenized: character 'x'"):
        load_datasets(cfg, tok, hf)


def test_skip_mode_skips_and_counts_both_kinds(tmp_path):
    cfg, tok, hf, path = _setup(tmp_path, {"prompt": "R 12=", "answer": "2x"}, on_bad_row="skip")
    train, _ = load_datasets(cfg, tok, hf)
    assert len(train) == 2 and train.bad_rows == [
        f"{path}:2: answer cannot be tokenized: character 'x' at position 1 of '2x' is not in the "
        "alphabet '0123456789+=RC '"
    ]
