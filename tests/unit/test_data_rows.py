"""Bad bytes and bad JSON in a jsonl data file are named by file, line and column, in both
``on_bad_row`` modes; skip mode skips just that row."""

import json

import pytest

from megarl.data.dataset import DataError, load_prompt_rows

GOOD = json.dumps({"prompt": "R 12=", "answer": "21"}).encode()


def _file(tmp_path, lines: list[bytes], end: bytes = b"\n"):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b"".join(line + end for line in lines))
    return p


@pytest.mark.parametrize("end", [b"\n", b"\r\n"])
def test_non_utf8_row_is_named_and_skipped(tmp_path, end):
    bad = b'{"prompt": "R \xff\xfe=", "answer": "1"}'
    p = _file(tmp_path, [GOOD, bad, GOOD], end)
    with pytest.raises(
        DataError,
        match=rf"{p}:2: not valid UTF-8 \(byte 0xff at byte column 15\) "
        r"\(data.on_bad_row=fatal",
    ):
        load_prompt_rows(str(p))
    rows, skipped = load_prompt_rows(str(p), on_bad_row="skip")
    assert [r.source for r in rows] == [f"{p}:1", f"{p}:3"]
    assert skipped == [f"{p}:2: not valid UTF-8 (byte 0xff at byte column 15)"]


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"no end"])
def test_json_error_column_does_not_count_the_line_end(tmp_path, end):
    cut = b'{"prompt": "R 1=", "answer": "1"'  # 32 characters, the closing brace missing
    p = _file(tmp_path, [GOOD, cut], end)
    if end == b"no end":  # the last line of the file without a line end
        p.write_bytes(GOOD + b"\n" + cut)
    rows, skipped = load_prompt_rows(str(p), on_bad_row="skip")
    assert len(rows) == 1
    assert skipped == [f"{p}:2: not valid JSON (Expecting ',' delimiter at column {len(cut) + 1})"]
    with pytest.raises(DataError, match=rf"{p}:2: not valid JSON \(Expecting ',' delimiter at column 33\)"):
        load_prompt_rows(str(p))


def test_blank_and_crlf_lines_are_read(tmp_path):
    p = _file(tmp_path, [GOOD, b"", b"  \t", GOOD], b"\r\n")
    rows, skipped = load_prompt_rows(str(p), on_bad_row="skip")
    assert [r.source for r in rows] == [f"{p}:1", f"{p}:4"] and skipped == []
    assert rows[0].prompt == "R 12=" and rows[0].answer == "21"
