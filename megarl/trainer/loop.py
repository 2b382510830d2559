"""The RL loop: a built ``Run`` stepped from its first step to ``schedule.steps``.

One step::

    rollouts (the run's rollout source: the collector now, or the async producer's queue)
      -> broadcast to every rank -> packed batch   (or the method's batch source's batch)
      -> sequences a step hook appends (``BatchExtender``: every rank, before the learner inputs)
      -> learner inputs (old logprobs, entropies, frozen models' passes: one each, as required)
      -> batch inputs (answer spans, method extras, reward dimensions) -> advantages
      -> ppo_epochs x mini_batches optimizer steps (step hooks around them)
      -> weight sync to the engine -> metrics -> checkpoint

Rank 0 drives the engine and the rewards; each data-parallel replica trains on its share of the
groups. Sampling seeds are derived from (seed, step, round, prompt), so a resumed run draws the
same samples as an uninterrupted one.
"""

from __future__ import annotations

import itertools
import signal
import time

import torch
import torch.distributed as dist

from megarl.objectives.api import GlobalNormalisers
from megarl.plugin.inputs import RolloutInfo
from megarl.rundir import read_metrics
from megarl.trainer import run_checkpoint
from megarl.trainer.config import TrainConfig
from megarl.trainer.evaluation import eval_text, evaluate
from megarl.trainer.live_progress import StepDisplay
from megarl.trainer.rollouts import Rollouts, build_batch, rollouts_from_groups
from megarl.trainer.run import Run
from megarl.trainer.setup import log
from megarl.trainer.step_metrics import batch_metrics, current_old_metrics, rollout_metrics


def mini_batch_bounds(num_groups: int, mini_batches: int, dp: int) -> list[int]:
    """Group boundaries of a step's mini-batches: at most ``mini_batches``, each with at least ``dp``
    groups so that every data-parallel replica gets one (a variable-size batch, e.g. from an
    allocator that commits few groups); [] when there are fewer groups than replicas."""
    if num_groups < dp:
        return []
    nmb = min(mini_batches, num_groups // dp)
    return torch.linspace(0, num_groups, nmb + 1).round().long().tolist()


class SyncRollouts:
    """The synchronous rollout source: each step's batch is collected when the step asks."""

    def __init__(self, run: Run):
        self.run = run

    def take(self, step: int) -> tuple[Rollouts, dict]:
        """Rank 0: the rollouts of ``step`` and their statistics."""
        r = self.run
        b = r.loop.run_until_complete(r.collector.collect(step))
        return rollouts_from_groups(
            b.groups, r.train_ds.task_id, r.rewards.names, with_versions=False
        ), b.stats

    def update_weights(self, version: int) -> None:
        """Sync the learner's weights to the engine (collective)."""
        from megarl.trainer.weights import sync_weights

        sync_weights(self.run, version)

    def state(self) -> dict:
        """What ``trainer.json`` holds for this source besides the sampler (nothing)."""
        return {}

    def close(self) -> None:
        """Nothing to stop."""


def build_run(cfg: TrainConfig) -> tuple[Run, int, dict]:
    """Assemble a run (resuming from the newest checkpoint when ``checkpoint.resume: auto``); returns
    the run, the step it starts after and the checkpoint's method state ({} when starting fresh)."""
    run = Run(cfg)
    run.setup()
    ckpt, init_dir = run.initial_policy()
    run.build_learners(init_dir)
    start, method_state, run.failures_total = 0, {}, {"errors": 0, "timeouts": 0}
    run.resumed_from = ckpt
    if ckpt is not None:
        state = run_checkpoint.load(ckpt, run.learner)
        run.objective.load_state_dict(run_checkpoint.load_objective_state(ckpt))
        method_state = run_checkpoint.load_method_state(ckpt)
        start = int(state["step"])
        run.sampler.load_state_dict(state["sampler"])
        run.failures_total = state.get("reward_failures", run.failures_total)
        if run.rank0:
            run.metrics.truncate_after(start)
        log(f"megarl train: resumed from {ckpt} (step {start})")
    elif run.rank0 and run.metrics.path.exists():
        run.metrics.truncate_after(0)
    return run, start, method_state


class Trainer:
    """Runs the loop over a built ``Run`` (``run()``); ``source_class`` makes the rollout source."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self._stop_signal: int | None = None

    def _install_signal_handlers(self) -> None:
        def handler(signum, frame):
            self._stop_signal = signum
            log(f"megarl train: got signal {signum}; checkpointing after this step, then exiting")

        for s in (signal.SIGTERM, signal.SIGUSR1):
            try:
                signal.signal(s, handler)
            except ValueError:  # not the main thread (tests)
                pass

    def make_source(self, run: Run, start: int):
        """The rollout source (the asynchronous loop overrides this)."""
        run.build_engine()
        run.build_rank0_parts()
        return SyncRollouts(run)

    def run(self) -> int:
        """Build the run, step it, checkpoint, finish; returns the exit code."""
        cfg = self.cfg
        run, start, method_state = build_run(cfg)
        self._install_signal_handlers()
        self.r = run
        self.source = self.make_source(run, start)
        if method_state:
            run.method.load_state_dict(method_state, rank0=run.rank0)
        if run.resumed_from is not None:
            run.method.load_sharded(run.resumed_from)
        run.build_faults()
        self.source.update_weights(start)
        if start == 0 and run.rank0 and not any(r.get("step") == 0 for r in read_metrics(run.run_dir)):
            rec = {"step": 0, **evaluate(run)}
            run.metrics.write(rec)
            log(f"step    0/{cfg.schedule.steps} (initial policy){eval_text(rec)}")
        progress = StepDisplay(cfg.schedule.steps, start, cfg.logging.progress, cfg.logging.print_every)
        code = 0
        for step in range(start + 1, cfg.schedule.steps + 1):
            rec = self.step(step)
            last = step == cfg.schedule.steps
            if run.rank0 and (last or (cfg.schedule.eval_every and step % cfg.schedule.eval_every == 0)):
                rec.update(evaluate(run))
            if run.rank0:
                run.metrics.write(rec)
                progress.show(step, rec, last)
            stop = self._stop_signal is not None
            if last or step % cfg.checkpoint.every == 0 or stop:
                self.checkpoint(step)
            if stop:
                code = 128 + int(self._stop_signal)
                break
        progress.close()
        self.finish()
        return code

    # ------------------------------------------------------------------------------ one step
    def step(self, step: int) -> dict:
        """One RL step (collective); returns its metrics record."""
        run, cfg = self.r, self.cfg
        t_step = time.time()
        rec: dict = {"step": step}
        if run.method.batch_source is not None:  # the method supplies the batches: no rollouts
            ro, rstats = None, {"gen_time": 0.0, "reward_time": 0.0}
            batch = run.method.batch_source.next_batch(step)
            info = RolloutInfo([""] * batch.num_seqs, {})
        else:
            payload: list = [self.source.take(step) if run.rank0 else None]
            if dist.get_world_size() > 1:
                dist.broadcast_object_list(payload, src=0)
            ro, rstats = payload[0]
            if not ro.group_ids:
                log(f"step {step}: every group had equal rewards (dynamic sampling); no update this step")
                rec.update(rollout_metrics(run, ro, rstats))
                self.source.update_weights(step)
                return rec
            batch = build_batch(ro, step)
            info = RolloutInfo(ro.answers, ro.reward_dims, ro.extras)
        run.method.add_round_extras(batch, info)  # learner passes may read them too
        batch, info = run.method.extend_batch(step, batch, info)  # sequences a method appends
        t0 = time.time()
        rec.update(run.method.fill_learner_inputs(batch, cfg.schedule.micro_batches))
        t_logprob = time.time() - t0
        rec.update(run.method.fill_batch_inputs(batch, info))
        run.method.advantages(batch)
        rec.update(run.method.advantages.metrics())
        for hook in run.method.step_hooks:
            batch = hook.before_train(step, batch)
        t0 = time.time()
        train_metrics = self._optimizer_steps(step, batch) if run.method.updates_policy(step) else []
        for hook in run.method.step_hooks:
            rec.update(hook.after_step(step, train_metrics[-1] if train_metrics else {}))
        t_train = time.time() - t0
        t0 = time.time()
        self.source.update_weights(step)
        t_sync = time.time() - t0
        for k in train_metrics[-1] if train_metrics else ():
            rec[f"train/{k}"] = sum(m[k] for m in train_metrics) / len(train_metrics)
        rec["train/optimizer_steps"] = len(train_metrics)
        if ro is not None:
            rec.update(rollout_metrics(run, ro, rstats))
        rec.update(batch_metrics(batch))
        if run.method.old_from_forward:  # the old logprobs were the training forward's
            rec.update(current_old_metrics(rec))
        train_tokens = batch.num_tokens * cfg.schedule.ppo_epochs
        rec.update(
            {
                "time/rollout": rstats["gen_time"],
                "time/reward": rstats["reward_time"],
                "time/logprob": t_logprob,
                "time/train": t_train,
                "time/sync": t_sync,
                "perf/train_tokens_per_s": train_tokens / max(t_train, 1e-9),
                "time/step": time.time() - t_step,
            }
        )
        rec.update(run.faults.end_step(step, rec))
        return rec

    def _optimizer_steps(self, step: int, batch) -> list[dict]:
        """``ppo_epochs`` x ``mini_batches`` optimizer steps over whole groups; their metrics."""
        run, s = self.r, self.cfg.schedule
        out: list[dict] = []
        gids = torch.unique(batch.group_ids).tolist()
        for _epoch in range(s.ppo_epochs):
            bounds = mini_batch_bounds(len(gids), s.mini_batches, run.groups.dp_size)
            if not bounds:
                log(f"step {step}: {len(gids)} group(s) for {run.groups.dp_size} replicas; no update")
                return out
            for a, b in itertools.pairwise(bounds):
                keep = set(gids[a:b])
                mb = batch.select([i for i, g in enumerate(batch.group_ids.tolist()) if g in keep])
                local = run.dp_share(mb)
                # L_max of seq-mean-token-sum-norm is the generation budget (Dr.GRPO's constant)
                norms = GlobalNormalisers.from_batch(local, run.dp_group(), self.cfg.rollout.max_new_tokens)
                micro = max(1, min(s.micro_batches, local.num_seqs))
                local = run.faults.before_train(step, local, run.objective, micro, norms)
                out.append(
                    run.learner.train_step(local, run.objective, micro, norms, run.method.old_from_forward)
                )
                run.faults.after_train(step, out[-1])
        return out

    # ------------------------------------------------------------------------------ state, end
    def checkpoint(self, step: int) -> None:
        """Save checkpoint ``step`` (collective)."""
        run = self.r
        t0 = time.time()
        state = {
            "sampler": run.sampler.state_dict(),
            "reward_failures": run.failures_total,
            "policy_version": step,
            "run_id": run.run_id,
            **self.source.state(),
        }
        path = run_checkpoint.save(
            run.run_dir,
            step,
            run.learner,
            state,
            self.cfg.checkpoint.keep_last,
            objective_state=run.objective.state_dict(),
            method_state=run.method.state_dict(),
            sharded_parts=run.method.sharded_parts(),
        )
        log(f"checkpoint {path} ({time.time() - t0:.1f}s)")

    def finish(self) -> None:
        """Stop the rollout source, close the method's parts, the rewards, metrics and engine; print
        the summary."""
        from megarl.trainer.step_metrics import print_summary

        run = self.r
        self.source.close()
        run.method.close()
        if run.rank0:
            run.rewards.close()
            print_summary(run)
            run.metrics.close()
        if run.engine is not None:
            run.loop.run_until_complete(run.engine.close())
        run.loop.close()


def trainer_class(cfg: TrainConfig) -> type[Trainer]:
    """``AsyncTrainer`` when ``async_loop.enabled``, else the synchronous ``Trainer``."""
    if cfg.async_loop.enabled:
        from megarl.trainer.async_loop import AsyncTrainer

        return AsyncTrainer
    return Trainer
