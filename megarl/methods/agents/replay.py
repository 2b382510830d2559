"""Replay files of REGEN: a run's episodes after the advantage step, written as Parquet and read
back by another run.

One file per RL step (``step_000001.parquet`` in the replay folder), one row per sequence:
``prompt_ids``, ``response_ids``, ``loss_mask`` and ``rollout_logprobs`` (per response token),
``advantage`` (A_b, the mean of the advantages over the loss tokens), ``behaviour_nll``
(z_b = −Σ_t of the rollout log-probs over the loss tokens), ``origin`` (``negative`` where A_b < 0,
else ``positive``), ``group_id`` and ``step``. The file's metadata holds ``megarl.tokenizer`` (a
fingerprint of the tokenizer's vocabulary) and ``megarl.chat_template`` (the template the prompts
were formatted with): a reader refuses a file whose values differ from its own run's, naming the
file and the field, since z_b is only meaningful for the same token ids.

Another run trains on the files through ``ReplaySource`` (a method's batch source), with the
advantage estimator ``stored`` (the replayed advantages as they are).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, per_token
from megarl.batch import PackedBatch, from_sequences
from megarl.methods.agents.regen import BEHAVIOUR_NLL, ORIGIN_NEGATIVE
from megarl.ops.segments import segment_masked_mean, segment_sum

STORED_ADVANTAGE = "stored_advantage"  # extras key: the replayed A_b, [B]
META_FIELDS = ("megarl.tokenizer", "megarl.chat_template")
ORIGINS = ("positive", "negative")
SCHEMA = pa.schema(
    [
        ("prompt_ids", pa.list_(pa.int64())),
        ("response_ids", pa.list_(pa.int64())),
        ("loss_mask", pa.list_(pa.float32())),
        ("rollout_logprobs", pa.list_(pa.float32())),
        ("advantage", pa.float64()),
        ("behaviour_nll", pa.float64()),
        ("origin", pa.string()),
        ("group_id", pa.int64()),
        ("step", pa.int64()),
    ]
)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's vocabulary (``get_vocab()``, else its alphabet) and size."""
    if hasattr(tokenizer, "get_vocab"):
        vocab: Any = sorted(tokenizer.get_vocab().items())
    else:
        vocab = getattr(tokenizer, "alphabet", None)
    if vocab is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has neither get_vocab() nor an alphabet")
    size = getattr(tokenizer, "vocab_size", None)
    blob = json.dumps([type(tokenizer).__name__, size, vocab], ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def chat_template(tokenizer: Any, use_template: bool) -> str:
    """The chat template prompts are formatted with: the tokenizer's, or ``none`` without one."""
    return (getattr(tokenizer, "chat_template", None) or "none") if use_template else "none"


def episode_rows(batch: PackedBatch, step: int) -> list[dict]:
    """One row per sequence of a batch whose ``advantages`` are filled (see the module docstring)."""
    if batch.advantages is None:
        raise ValueError("replay: the batch has no 'advantages' (write after the advantage step)")
    behaviour = batch.rollout_logprobs if batch.rollout_logprobs is not None else batch.old_logprobs
    if behaviour is None:
        raise ValueError("replay: the batch has neither 'rollout_logprobs' nor 'old_logprobs'")
    m, cu = batch.loss_mask.double(), batch.cu_seqlens
    adv = segment_masked_mean(batch.advantages.double(), m, cu)
    nll = -segment_sum(behaviour.double() * m, cu)
    rows = []
    for b in range(batch.num_seqs):
        s, e, p = int(cu[b]), int(cu[b + 1]), int(batch.prompt_lens[b])
        rows.append(
            {
                "prompt_ids": batch.tokens[s : s + p].tolist(),
                "response_ids": batch.tokens[s + p : e].tolist(),
                "loss_mask": batch.loss_mask[s + p : e].float().tolist(),
                "rollout_logprobs": behaviour[s + p : e].float().tolist(),
                "advantage": float(adv[b]),
                "behaviour_nll": float(nll[b]),
                "origin": "negative" if float(adv[b]) < 0 else "positive",
                "group_id": int(batch.group_ids[b]),
                "step": step,
            }
        )
    return rows


def write_episodes(path: Path, rows: list[dict], tokenizer_id: str, template: str) -> None:
    """Write ``rows`` to the Parquet file ``path`` with the tokenizer fingerprint and template."""
    meta = {b"megarl.tokenizer": tokenizer_id.encode(), b"megarl.chat_template": template.encode()}
    table = pa.Table.from_pylist(rows, schema=SCHEMA.with_metadata(meta))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def check_file(path: Path, tokenizer_id: str, template: str) -> pa.Table:
    """The file's table; a missing column or a metadata field that differs from this run's is an
    error naming the file and the field."""
    table = pq.read_table(path)
    meta = table.schema.metadata or {}
    want = {"megarl.tokenizer": tokenizer_id, "megarl.chat_template": template}
    for key in META_FIELDS:
        got = meta.get(key.encode())
        if got is None:
            raise ValueError(f"replay file {path}: metadata field {key!r} is missing")
        if got.decode() != want[key]:
            raise ValueError(
                f"replay file {path}: metadata field {key!r} is {got.decode()[:80]!r}, this run's is "
                f"{want[key][:80]!r} (replay episodes with the tokenizer and template that made them)"
            )
    missing = [f for f in SCHEMA.names if f not in table.column_names]
    if missing:
        raise ValueError(f"replay file {path}: missing column(s) {missing}")
    for i, o in enumerate(table.column("origin").to_pylist()):
        if o not in ORIGINS:
            raise ValueError(
                f"replay file {path}: row {i} field 'origin' is {o!r}; allowed: {', '.join(ORIGINS)}"
            )
    return table


@dataclass
class ReplayReader:
    """Episodes of the replay files in ``folder`` (sorted by name), in order, from a cursor saved in
    checkpoints; every file is checked against this run's tokenizer fingerprint and template."""

    folder: Path
    tokenizer_id: str
    template: str
    file_index: int = 0
    row: int = 0

    def files(self) -> list[Path]:
        """The folder's replay files, sorted."""
        return sorted(Path(self.folder).glob("*.parquet"))

    def next_rows(self, n: int) -> list[dict]:
        """Up to ``n`` episodes from the cursor on (fewer at the end of the last file)."""
        out: list[dict] = []
        files = self.files()
        while len(out) < n and self.file_index < len(files):
            rows = check_file(files[self.file_index], self.tokenizer_id, self.template).to_pylist()
            take = rows[self.row : self.row + n - len(out)]
            out += take
            self.row += len(take)
            if self.row >= len(rows):
                self.file_index, self.row = self.file_index + 1, 0
        return out

    def state_dict(self) -> dict:
        """The cursor."""
        return {"file_index": self.file_index, "row": self.row}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""
        self.file_index, self.row = int(state["file_index"]), int(state["row"])


def episodes_batch(rows: list[dict]) -> PackedBatch:
    """A packed batch of replayed episodes: the stored loss mask and rollout log-probs per token, the
    stored advantages used as they are (broadcast over the loss tokens, and in ``extras`` as
    ``stored_advantage``), ``extras`` ``behaviour_nll``/``origin_negative``; one group per stored
    (step, group_id)."""
    keys = [(r["step"], r["group_id"]) for r in rows]
    dense = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    b = from_sequences(
        [r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows], [dense[k] for k in keys]
    )
    b.rollout_logprobs = torch.zeros(b.num_tokens, dtype=torch.float32)
    for i, r in enumerate(rows):
        s, n = int(b.cu_seqlens[i]) + len(r["prompt_ids"]), len(r["response_ids"])
        b.loss_mask[s : s + n] = torch.tensor(r["loss_mask"], dtype=b.loss_mask.dtype)
        b.rollout_logprobs[s : s + n] = torch.tensor(r["rollout_logprobs"], dtype=torch.float32)
    adv = torch.tensor([r["advantage"] for r in rows], dtype=torch.float64)
    b.advantages = (adv[b.seq_index()] * b.loss_mask.double()).float()
    b.extras = {
        STORED_ADVANTAGE: adv,
        BEHAVIOUR_NLL: torch.tensor([r["behaviour_nll"] for r in rows], dtype=torch.float64),
        ORIGIN_NEGATIVE: torch.tensor([float(r["origin"] == "negative") for r in rows], dtype=torch.float64),
    }
    return b


def stored(batch: PackedBatch) -> torch.Tensor:
    """The advantage estimator ``stored``: the replayed sequence advantages as they are, [T]."""
    if STORED_ADVANTAGE not in batch.extras:
        raise ValueError(
            "advantage.estimator=stored needs replayed episodes (extras.stored_advantage; method.replay_in)"
        )
    return per_token(batch, batch.extras[STORED_ADVANTAGE])


class ReplaySource:
    """The run's batches from replay files (a method's ``batch_source``): ``size`` episodes per RL
    step from the reader's cursor, starting over at the first file after the last (``epoch`` counts
    the passes). Every rank reads the same files, so every rank gets the same batch."""

    def __init__(self, reader: ReplayReader, size: int):
        if not reader.files():
            raise ValueError(f"method.replay_in: no replay files (*.parquet) in {reader.folder}")
        self.reader, self.size, self.epoch = reader, size, 0

    def next_batch(self, step: int) -> PackedBatch:
        """The step's batch of replayed episodes."""
        rows = self.reader.next_rows(self.size)
        while len(rows) < self.size:
            self.reader.file_index, self.reader.row, self.epoch = 0, 0, self.epoch + 1
            rows += self.reader.next_rows(self.size - len(rows))
        return episodes_batch(rows)

    def state_dict(self) -> dict:
        """The reader's cursor and the pass count."""
        return {**self.reader.state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""
        self.reader.load_state_dict(state)
        self.epoch = int(state["epoch"])


ADVANTAGE_ESTIMATORS.add("stored", stored)


class ReplayWriter:
    """Step hook: writes each RL step's episodes (rank 0) to ``folder/step_NNNNNN.parquet`` after the
    advantage step; the policy update is untouched."""

    def __init__(self, folder: Path, tokenizer_id: str, template: str, rank0: bool):
        self.folder, self.tokenizer_id, self.template, self.rank0 = (
            Path(folder),
            tokenizer_id,
            template,
            rank0,
        )
        self.written = 0
        self._last = 0

    def before_train(self, step: int, batch: PackedBatch) -> PackedBatch:
        """Write the step's episodes; returns the batch unchanged."""
        self._last = 0
        if self.rank0:
            rows = episode_rows(batch, step)
            write_episodes(self.folder / f"step_{step:06d}.parquet", rows, self.tokenizer_id, self.template)
            self._last = len(rows)
            self.written += len(rows)
        return batch

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        """``regen/replay_written``: episodes written this step (rank 0)."""
        return {"regen/replay_written": float(self._last)} if self.rank0 else {}

    def state_dict(self) -> dict:
        """Episodes written so far."""
        return {"written": self.written}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""
        self.written = int(state["written"])
