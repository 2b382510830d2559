"""Parquet prompt datasets (bad rows named by file and row index), chat templates of a real HF
tokenizer (the tiny-qwen3 fixture's), and the math-verify reward in its contained worker."""

import json

import pytest

from megarl.data.chat import chat_renderer
from megarl.data.dataset import DataError, load_prompt_rows
from megarl.data.tokenizer import CharTokenizer
from megarl.rewards.compute import RewardComputer
from megarl.trainer.config import RewardConfig, RewardFunctionConfig

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_parquet_rows_glob_and_template(tmp_path):
    write_parquet(tmp_path / "a.parquet", [{"question": "12", "gt": 21, "kind": "rev"}])
    write_parquet(
        tmp_path / "b.parquet",
        [{"question": "34", "gt": 43, "kind": "rev"}, {"question": "56", "gt": 65, "kind": "rev2"}],
    )
    (tmp_path / "c.jsonl").write_text(json.dumps({"question": "78", "gt": "87"}) + "\n")
    rows, bad = load_prompt_rows(
        str(tmp_path / "*"),
        prompt_field="question",
        answer_field="gt",
        task_field="kind",
        prompt_template="R {prompt}=",
    )
    assert bad == []
    assert [(r.prompt, r.answer, r.task) for r in rows] == [
        ("R 12=", "21", "rev"),
        ("R 34=", "43", "rev"),
        ("R 56=", "65", "rev2"),
        ("R 78=", "87", "default"),
    ]
    assert (
        rows[2].source == f"{tmp_path / 'b.parquet'}: row 1" and rows[3].source == f"{tmp_path / 'c.jsonl'}:1"
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt": None, "answer": "1"}, "field 'prompt' must be a non-empty string, got None"),
        ({"prompt": "R 1=", "answer": None}, "field 'answer' must be a string or number, got None"),
        ({"prompt": "R x=", "answer": "1"}, "prompt cannot be tokenized: character 'x'"),
    ],
)
def test_bad_parquet_row_is_named_by_file_and_row_index(tmp_path, bad, message):
    p = write_parquet(
        tmp_path / "d.parquet", [{"prompt": "R 12=", "answer": "21"}, bad, {"prompt": "R 3=", "answer": "3"}]
    )
    tok = CharTokenizer("0123456789R =")
    with pytest.raises(DataError, match=f"d.parquet: row 1: {message}"):
        load_prompt_rows(str(p), check_prompt=tok.encode)
    rows, skipped = load_prompt_rows(str(p), check_prompt=tok.encode, on_bad_row="skip")
    assert len(rows) == 2 and len(skipped) == 1 and skipped[0].startswith(f"{p}: row 1: {message}")


def test_unreadable_parquet_and_unknown_extension(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"x.parquet: not a readable parquet file"):
        load_prompt_rows(str(tmp_path / "x.parquet"))
    (tmp_path / "y.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"y.csv: unsupported dataset file; allowed: .jsonl, .json"):
        load_prompt_rows(str(tmp_path / "y.csv"))


def test_chat_template_of_a_real_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from megarl.testing.tiny_qwen3 import find_tiny_qwen3_fixture

    tok = transformers.AutoTokenizer.from_pretrained(str(find_tiny_qwen3_fixture()))
    render = chat_renderer(tok, system_prompt="Be brief.")
    text = render("What is 2+3?")
    want = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == want and "What is 2+3?" in text and text != "What is 2+3?"
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "2+3", "answer": "5"}) + "\n")
    rows, _ = load_prompt_rows(str(p), prompt_template="What is {prompt}?", chat=render)
    assert rows[0].prompt == want


def test_chat_template_missing_is_a_clear_error():
    class NoTemplate:
        chat_template = None

    with pytest.raises(DataError, match="tokenizer has no chat template"):
        chat_renderer(NoTemplate())


def test_math_verify_reward_is_contained():
    pytest.importorskip("math_verify")
    comp = RewardComputer(
        RewardConfig(
            functions=[RewardFunctionConfig(name="math", kind="math_verify")], timeout_s=20.0, fallback=-1.0
        )
    )
    try:
        res = comp(
            ["so the answer is \\boxed{\\frac{1}{2}}", "\\boxed{3}", "x = 0.5", "\\boxed{7}"],
            ["0.5", "2", "$\\frac{1}{2}$", "}{"],
        )
        assert res.dims["math"].tolist() == [1.0, 0.0, 1.0, -1.0]
        assert res.errors == 1 and "has no parsable answer" in res.failures[0]
    finally:
        comp.close()
