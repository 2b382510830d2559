"""Prompt datasets from jsonl or parquet files and a resumable, seeded prompt sampler.

A bad row (not UTF-8, not JSON, not an object, missing or non-string prompt, answer missing, a prompt
or answer the tokenizer cannot encode, a prompt that fills the model's context window) is reported
as ``file:line: reason`` (jsonl, 1-based lines) or ``file: row N: reason`` (parquet, 0-based row
index). ``on_bad_row="fatal"`` stops at the first one; ``"skip"`` skips and counts them, and more
than ``max_bad_rows`` is fatal (with the first few listed).
"""

from __future__ import annotations

import glob
import json
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any


class DataError(ValueError):
    """A dataset file or row is unusable; the message names the file and line."""


@dataclass(frozen=True)
class PromptRow:
    """One prompt: its rendered text, ground truth, task name and where it came from."""

    prompt: str
    answer: str
    task: str
    source: str  # "file:line"


def _files(pattern: str) -> list[str]:
    paths = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
    if not paths:
        raise DataError(f"no file matches {pattern!r}")
    for p in paths:
        if not os.path.isfile(p):
            raise DataError(f"{p}: no such file")
        if not p.endswith((".jsonl", ".json", ".parquet")):
            raise DataError(f"{p}: unsupported dataset file; allowed: .jsonl, .json (JSON lines), .parquet")
    return paths


def _records(path: str) -> Iterator[tuple[str, Any]]:
    """(where, record) for every row of one file; a jsonl line that is not JSON yields a ``_BadJSON``."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq

            table = pq.read_table(path)
        except ImportError:
            raise DataError(f"{path}: reading parquet needs the pyarrow package") from None
        except Exception as e:  # pyarrow raises several types for a broken file
            raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
        for i, rec in enumerate(table.to_pylist()):
            yield f"{path}: row {i}", rec
        return
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            yield from _jsonl_record(f"{path}:{lineno}", raw)


def _jsonl_record(where: str, raw: bytes) -> Iterator[tuple[str, Any]]:
    """(where, record) of one jsonl line (bytes, line end included); nothing for a blank line.

    A line that is not UTF-8 or not JSON yields a ``_BadJSON``; columns are 1-based and do not
    count the line end.
    """
    line = raw.rstrip(b"\r\n")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        yield where, _BadJSON(f"not valid UTF-8 (byte 0x{line[e.start]:02x} at byte column {e.start + 1})")
        return
    if not text.strip():
        return
    try:
        yield where, json.loads(text)
    except json.JSONDecodeError as e:
        yield where, _BadJSON(f"not valid JSON ({e.msg} at column {e.colno})")


@dataclass(frozen=True)
class _BadJSON:
    why: str


def load_prompt_rows(
    pattern: str,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    task_field: str = "task",
    prompt_template: str = "{prompt}",
    check_prompt: Callable[[str], Sequence[int] | None] | None = None,
    on_bad_row: str = "fatal",
    max_bad_rows: int = 10,
    chat: Callable[[str], str] | None = None,
    check_answer: Callable[[str], object] | None = None,
    context_len: int | None = None,
) -> tuple[list[PromptRow], list[str]]:
    """Rows of every file (jsonl or parquet) matching ``pattern`` and the bad-row messages (skip mode).

    ``prompt_template`` is a ``str.format`` template over the row's fields (``{prompt}`` by default).
    ``chat(text) -> text`` wraps the filled template in a chat template (``megarl.data.chat``).
    ``check_prompt(text)`` raises ``ValueError`` for a prompt the model cannot take and may return
    the prompt's token ids: with ``context_len`` (the model's context window) a prompt of
    ``context_len`` tokens or more is a bad row (no room for a response). ``check_answer(answer)``
    raises ``ValueError`` for a ground truth the tokenizer cannot encode.
    """
    rows: list[PromptRow] = []
    bad: list[str] = []

    def report(where: str, why: str) -> None:
        msg = f"{where}: {why}"
        if on_bad_row == "fatal":
            raise DataError(msg + " (data.on_bad_row=fatal; set data.on_bad_row=skip to skip bad rows)")
        bad.append(msg)
        if len(bad) > max_bad_rows:
            raise DataError(
                f"more than data.max_bad_rows={max_bad_rows} bad rows; first ones:\n  " + "\n  ".join(bad[:5])
            )

    for path in _files(pattern):
        for where, obj in _records(path):
            if isinstance(obj, _BadJSON):
                report(where, obj.why)
                continue
            if not isinstance(obj, dict):
                report(where, f"expected a JSON object, got {type(obj).__name__}")
                continue
            p = obj.get(prompt_field)
            if not isinstance(p, str) or not p:
                report(where, f"field {prompt_field!r} must be a non-empty string, got {p!r}")
                continue
            a = obj.get(answer_field)
            if isinstance(a, (int, float)) and not isinstance(a, bool):
                a = str(a)
            if not isinstance(a, str):
                report(where, f"field {answer_field!r} must be a string or number, got {a!r}")
                continue
            try:
                text = prompt_template.format(**{**obj, "prompt": p})
            except (KeyError, IndexError, ValueError) as e:
                report(where, f"data.prompt_template {prompt_template!r} cannot be filled: {e!r}")
                continue
            if chat is not None:
                try:
                    text = chat(text)
                except Exception as e:  # a template error is this row's problem
                    report(where, f"the chat template failed: {type(e).__name__}: {e}")
                    continue
            if check_prompt is not None:
                try:
                    ids = check_prompt(text)
                except ValueError as e:
                    report(where, f"prompt cannot be tokenized: {e}")
                    continue
                if context_len is not None and ids is not None and len(ids) >= context_len:
                    report(
                        where,
                        f"prompt is {len(ids)} tokens; the model's context window (max_position_embeddings) "
                        f"is {context_len} tokens, which leaves no room for a response",
                    )
                    continue
            if check_answer is not None:
                try:
                    check_answer(a)
                except ValueError as e:
                    report(where, f"answer cannot be tokenized: {e}")
                    continue
            rows.append(
                PromptRow(prompt=text, answer=a, task=str(obj.get(task_field, "default")), source=where)
            )
    if not rows:
        raise DataError(f"{pattern}: no usable row")
    return rows, bad


load_jsonl_rows = load_prompt_rows  # the name of the jsonl-only first version


class PromptDataset:
    """The rows of a dataset plus the task-name -> id map (``task_ids`` of the batch)."""

    def __init__(self, rows: list[PromptRow], bad_rows: list[str] | None = None):
        self.rows = rows
        self.bad_rows = bad_rows or []
        self.task_names = sorted({r.task for r in rows})
        self.task_id = {t: i for i, t in enumerate(self.task_names)}

    def __len__(self) -> int:
        return len(self.rows)


class PromptSampler:
    """Seeded epoch-wise shuffling with a cursor; ``state_dict``/``load_state_dict`` resume it exactly."""

    def __init__(self, num_rows: int, seed: int):
        self.num_rows, self.seed = num_rows, seed
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.num_rows))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_indices(self, n: int) -> list[int]:
        """The next ``n`` row indices (wrapping into a new shuffled epoch)."""
        out = []
        while len(out) < n:
            if self.cursor >= self.num_rows:
                self.epoch += 1
                self.cursor = 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(out), self.num_rows - self.cursor)
            out += self._order[self.cursor : self.cursor + take]
            self.cursor += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "num_rows": self.num_rows, "seed": self.seed}

    def load_state_dict(self, st: dict) -> None:
        if st["num_rows"] != self.num_rows:
            raise DataError(
                f"the checkpoint's sampler saw {st['num_rows']} rows, the dataset now has "
                f"{self.num_rows}: the data changed since the checkpoint"
            )
        self.epoch, self.cursor, self.seed = int(st["epoch"]), int(st["cursor"]), int(st["seed"])
        self._order = self._permutation(self.epoch)
