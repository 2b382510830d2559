"""Held-out evaluation on rank 0: pass@1 (greedy) and pass@k (k samples at the rollout temperature)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch


async def _generate(run: Any, rows: list, n: int, step: int, greedy: bool = False) -> list:
    return await asyncio.gather(
        *[
            run.engine.generate(
                run.tok.encode(r.prompt), n=n, sampling=run.sampling_params(step, 0, i, greedy)
            )
            for i, r in enumerate(rows)
        ]
    )


def _correct(res: Any) -> torch.Tensor:
    """The correctness verdicts of a ``RewardResult`` (the reward marked ``correct``)."""
    if res.correct is None:
        raise ValueError("several rewards and none marked `correct: true` in reward.functions")
    return res.correct


def evaluate(run: Any) -> dict:
    """``eval/pass@1``, ``eval/reward_greedy`` (the weighted sum) and, with ``schedule.eval_k > 1``,
    ``eval/pass@k``, ``eval/sampled_acc`` and, for an eval set of several tasks, the sampled accuracy
    per task (``per_task``) on the first ``schedule.eval_samples`` eval prompts ({} without an eval
    set). Correct means the correctness reward's verdict (megarl/rewards/correctness.py),
    not a threshold on the weighted sum."""
    if run.eval_ds is None:
        return {}
    s = run.cfg.schedule
    rows = run.eval_ds.rows[: s.eval_samples]
    t0 = time.time()
    greedy = run.loop.run_until_complete(_generate(run, rows, 1, step=-1, greedy=True))
    texts = [run.tok.decode(g.samples[0].token_ids) for g in greedy]
    res = run.rewards(texts, [r.answer for r in rows])
    out = {
        "eval/pass@1": float(_correct(res).float().mean()),
        "eval/reward_greedy": float(res.scalar.mean()),
    }
    if s.eval_k > 1:
        samp = run.loop.run_until_complete(_generate(run, rows, s.eval_k, step=-2))
        texts = [run.tok.decode(x.token_ids) for g in samp for x in g.samples]
        answers = [r.answer for r in rows for _ in range(s.eval_k)]
        ck = _correct(run.rewards(texts, answers)).view(len(rows), s.eval_k)
        out[f"eval/pass@{s.eval_k}"] = float(ck.any(1).float().mean())
        out["eval/sampled_acc"] = float(ck.float().mean())
        out.update(per_task(rows, ck))
    out["time/eval"] = time.time() - t0
    return out


def per_task(rows: list, correct: torch.Tensor) -> dict:
    """``eval/task/<task>/sampled_acc`` and ``.../samples`` per task of an eval set with several
    tasks ({} with one); ``correct``: [rows, k] verdicts."""
    tasks = sorted({r.task for r in rows})
    if len(tasks) < 2:
        return {}
    out = {}
    for t in tasks:
        ck = correct[[i for i, r in enumerate(rows) if r.task == t]]
        out[f"eval/task/{t}/sampled_acc"] = float(ck.float().mean())
        out[f"eval/task/{t}/samples"] = float(ck.numel())
    return out


def eval_text(rec: dict) -> str:
    """The held-out numbers of a record for the progress line."""
    parts = [
        f"{k[5:]} {v:.3f}"
        for k, v in rec.items()
        if k.startswith("eval/")
        and k != "eval/reward_greedy"
        and not k.startswith("eval/task/")
        and isinstance(v, float)
    ]
    return ("  | held-out " + "  ".join(parts)) if parts else ""
