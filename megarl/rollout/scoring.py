"""Teacher-forced scoring of given token ids by an engine (no sampling): what a teacher served by a
rollout engine gives a distillation run.

``TokenScores`` holds, for a sequence ``ids`` of n tokens, ``logprobs[i] = log p(ids[i] | ids[:i])``
(``logprobs[0] = 0.0``: the first token has no prefix, as in megarl's batch convention) and,
when asked, the top-K alternatives of every position (ids and logprobs, best first; row 0 empty).
Logprobs are the model's raw distribution (no temperature, no top-p), as both servers report them.

The request and response forms of each engine, measured on the servers the tests run:
- vLLM (``/v1/completions``): the ids as ``prompt``, ``max_tokens: 1`` (0 is refused:
  "max_tokens must be at least 1") and ``prompt_logprobs: K``; ``choices[0].prompt_logprobs`` is
  ``[null, {"<id>": {"logprob", "rank"}, ...}, ...]``: at each position the scored token and the
  K best (by ``rank``, 1 = best), so K+1 entries when the scored token is not among them.
- SGLang (``/generate``): ``input_ids``, ``return_logprob``, ``logprob_start_len: 0`` and
  ``top_logprobs_num: K``; ``meta_info.input_token_logprobs`` is ``[[logprob, id, text], ...]``
  with ``null`` as the first logprob, ``meta_info.input_top_logprobs`` the K best per position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megarl.rollout.types import RolloutError


@dataclass
class TokenScores:
    """Scores of n given tokens: ``logprobs`` [n] (``[0] = 0.0``); ``top_ids`` / ``top_logprobs``
    [n][K] (row 0 empty; empty lists when K = 0)."""

    logprobs: list[float]
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


def vllm_score_body(model: str, ids: Sequence[int], top_k: int) -> dict:
    """The ``/v1/completions`` body that scores ``ids`` (one throw-away generated token)."""
    return {
        "model": model,
        "prompt": list(ids),
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": int(top_k),
        "return_token_ids": True,
    }


def parse_vllm_scores(engine: str, body: Any, ids: Sequence[int], top_k: int) -> TokenScores:
    """``TokenScores`` from a vLLM completions response to ``vllm_score_body``."""
    try:
        rows = body["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError) as e:
        raise RolloutError(f"{engine}: response has no prompt_logprobs ({e!r}): {str(body)[:300]}") from e
    if not isinstance(rows, list) or len(rows) != len(ids):
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise RolloutError(f"{engine}: {len(ids)} tokens scored but {got} prompt_logprobs came back")
    out = TokenScores(logprobs=[0.0], top_ids=[[]] if top_k else [], top_logprobs=[[]] if top_k else [])
    for i in range(1, len(ids)):
        row = rows[i] or {}
        entry = row.get(str(ids[i]))
        if entry is None:
            raise RolloutError(f"{engine}: prompt_logprobs position {i} lacks the scored token {ids[i]}")
        out.logprobs.append(float(entry["logprob"]))
        if top_k:
            best = sorted(((int(v["rank"]), int(t), float(v["logprob"])) for t, v in row.items()))
            best = [b for b in best if b[0] <= top_k][:top_k]
            out.top_ids.append([b[1] for b in best])
            out.top_logprobs.append([b[2] for b in best])
    return out


def sglang_score_body(ids: Sequence[int], top_k: int) -> dict:
    """The ``/generate`` body that scores ``ids`` (one throw-away generated token)."""
    body: dict[str, Any] = {
        "input_ids": list(ids),
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if top_k:
        body["top_logprobs_num"] = int(top_k)
    return body


def parse_sglang_scores(engine: str, body: Any, ids: Sequence[int], top_k: int) -> TokenScores:
    """``TokenScores`` from an SGLang ``/generate`` response to ``sglang_score_body``."""
    try:
        meta = (body[0] if isinstance(body, list) else body)["meta_info"]
        triples = meta["input_token_logprobs"]
        tops = meta.get("input_top_logprobs") if top_k else None
    except (KeyError, IndexError, TypeError) as e:
        raise RolloutError(
            f"{engine}: response has no input_token_logprobs ({e!r}): {str(body)[:300]}"
        ) from e
    if len(triples) != len(ids) or [int(t[1]) for t in triples] != [int(t) for t in ids]:
        raise RolloutError(f"{engine}: input_token_logprobs do not match the {len(ids)} scored tokens")
    out = TokenScores(logprobs=[0.0], top_ids=[[]] if top_k else [], top_logprobs=[[]] if top_k else [])
    for i in range(1, len(ids)):
        out.logprobs.append(float(triples[i][0]))
        if top_k:
            if tops is None or len(tops) != len(ids):
                raise RolloutError(f"{engine}: asked for top-{top_k} but input_top_logprobs is missing")
            row = list(tops[i] or [])[:top_k]
            out.top_ids.append([int(t[1]) for t in row])
            out.top_logprobs.append([float(t[0]) for t in row])
    return out
