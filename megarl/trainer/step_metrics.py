"""The metrics of a step's rollouts and batch, and the end-of-run summary."""

from __future__ import annotations

from typing import Any

import torch

from megarl.rewards.correctness import CORRECT_VALUE
from megarl.rundir import read_metrics
from megarl.trainer.rollouts import Rollouts
from megarl.trainer.setup import log


def rollout_metrics(run: Any, ro: Rollouts, rs: dict) -> dict:
    """Rewards per dimension, the accuracy of the samples (``rollout/accuracy``), lengths,
    truncation, dynamic-sampling, budget and reward-failure counters; the round processors' metrics and any
    the rollout source added (``rs["async"]``)."""
    run.failures_total["errors"] += rs["errors"]
    run.failures_total["timeouts"] += rs["timeouts"]
    run.failures_total["worker_deaths"] = run.failures_total.get("worker_deaths", 0) + rs.get(
        "worker_deaths", 0
    )
    rec: dict = {}
    if ro.rewards:
        r = torch.tensor(ro.rewards)
        rec.update({"reward/mean": float(r.mean()), "reward/std": float(r.std()) if r.numel() > 1 else 0.0})
        for k, v in ro.reward_dims.items():
            t = torch.tensor(v)
            rec[f"reward/{k}/mean"] = float(t.mean())
            rec[f"reward/{k}/std"] = float(t.std()) if t.numel() > 1 else 0.0
        cname = getattr(run.rewards, "correct_name", None)
        if cname in ro.reward_dims:  # the correctness check's verdicts, not a threshold on the sum
            rec["rollout/accuracy"] = float(
                (torch.tensor(ro.reward_dims[cname]) >= CORRECT_VALUE).float().mean()
            )
        lens = torch.tensor([len(x) for x in ro.response_ids], dtype=torch.float32)
        rec.update(
            {
                "rollout/response_len": float(lens.mean()),
                "rollout/response_len_max": float(lens.max()),
                "rollout/truncated_frac": float(torch.tensor(ro.truncated, dtype=torch.float32).mean()),
                "rollout/samples": len(ro.rewards),
            }
        )
        rec["rollout/example"] = ro.responses[0]
    rec.update(
        {
            "rollout/zero_var_group_frac": rs["groups_zero_var"] / max(rs["groups_seen"], 1),
            "rollout/groups_seen": rs["groups_seen"],
            "rollout/sampling_rounds": rs["rounds"],
            "perf/rollout_tokens_per_s": rs["gen_tokens"] / max(rs["gen_time"], 1e-9),
            "reward/fn_errors": rs["errors"],
            "reward/fn_timeouts": rs["timeouts"],
            "reward/fn_errors_total": run.failures_total["errors"],
            "reward/fn_timeouts_total": run.failures_total["timeouts"],
        }
    )
    rec.update(budget_metrics(rs))
    rec.update(rs.get("method", {}))
    rec.update(rs.get("async", {}))
    return rec


def budget_metrics(rs: dict) -> dict:
    """The step's rollout spend: samples and tokens generated, those in groups with a non-zero
    gradient (rewards that differ), and the samples saved against the fixed allocation
    (``prompts_per_step`` groups of ``n``; negative when the step spent more)."""
    if "budget_samples" not in rs:  # statistics of a checkpoint written before budget counters
        return {}
    s, fixed = rs["budget_samples"], rs["budget_fixed"]
    return {
        "budget/samples": s,
        "budget/tokens": rs["budget_tokens"],
        "budget/samples_effective": rs["budget_samples_effective"],
        "budget/tokens_effective": rs["budget_tokens_effective"],
        "budget/groups_effective": rs["budget_groups_effective"],
        "budget/effective_frac": rs["budget_samples_effective"] / max(s, 1),
        "budget/samples_saved_vs_fixed": fixed - s,
    }


def batch_metrics(batch) -> dict:
    """Advantage statistics, the old-vs-rollout logprob gap (a check of the weight sync and of the
    two forwards) and the old-vs-reference KL. A batch with no loss token left (a method that drops
    every sample of the step) reports advantages of 0 and no logprob statistics."""
    m = batch.loss_mask.bool()
    adv = batch.advantages[m]
    rec = {
        "adv/mean": float(adv.mean()) if adv.numel() else 0.0,
        "adv/std": float(adv.std()) if adv.numel() > 1 else 0.0,
        "adv/abs_max": float(adv.abs().max()) if adv.numel() else 0.0,
    }
    if not bool(m.any()):
        return rec
    if batch.old_logprobs is not None:
        rec["rollout/logprob_gap_old"] = float(
            (batch.old_logprobs[m] - batch.rollout_logprobs[m]).abs().mean()
        )
    if batch.ref_logprobs is not None and batch.old_logprobs is not None:
        rec["rollout/kl_old_ref"] = float((batch.old_logprobs[m] - batch.ref_logprobs[m]).mean())
    return rec


def current_old_metrics(rec: dict) -> dict:
    """The old-vs-rollout gap and old-vs-reference KL of a step whose old logprobs were the
    training forward's (one optimizer step): the objective's ``train/`` figures of that forward."""
    out = {}
    if "train/train_rollout_logprob_gap" in rec:
        out["rollout/logprob_gap_old"] = rec["train/train_rollout_logprob_gap"]
    if "train/kl_old_ref" in rec:
        out["rollout/kl_old_ref"] = rec["train/kl_old_ref"]
    return out


def print_summary(run: Any) -> None:
    """Rank 0 at the end: the reward curve's path and the held-out numbers first vs last."""
    if run.cfg.logging.plot:
        from megarl.trainer.plot import plot_run

        png = plot_run(run.run_dir)
        if png is not None:
            log(f"reward curve: {png}")
    recs = read_metrics(run.run_dir)
    first = next((r for r in recs if "eval/pass@1" in r), None)
    last = next((r for r in reversed(recs) if "eval/pass@1" in r), None)
    if first is not None and last is not None and first is not last:
        for k in [
            k
            for k in first
            if k.startswith("eval/")
            and isinstance(first[k], float)
            and k != "eval/reward_greedy"
            and k in last
        ]:
            log(
                f"held-out {k[5:]}: {first[k]:.3f} (step {first['step']}) -> {last[k]:.3f} "
                f"(step {last['step']})"
            )
    log(f"metrics: {run.run_dir / 'metrics.jsonl'}")
