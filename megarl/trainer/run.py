"""``build_run(cfg) -> Run``: everything a run needs, assembled up front in a fixed order.

Phases (each a method, so tools such as the per-example smoke runner can rebuild one part):
``setup`` (tokenizer, datasets, process groups, run directory, reward functions, sampler),
``initial_policy`` (warm-up when needed), ``build_learners`` (the policy, the learner-side method
parts: reference and other frozen-model input passes; the objective), ``build_engine`` (rank 0's
rollout engine and the event loop it runs on), ``build_rank0_parts`` (round processors, the
method's own parts, the rollout collector) and ``build_faults``. The step loop
(megarl/trainer/loop.py) only steps.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.batch import PackedBatch
from megarl.learner.factory import build_learner
from megarl.plugin.context import RunContext
from megarl.rewards.compute import RewardComputer
from megarl.rundir import INIT_POLICY
from megarl.trainer.checkpoint_check import ForeignCheckpointError, resume_checkpoint
from megarl.trainer.config import (
    ConfigError,
    TrainConfig,
    check_layout,
    method_knobs,
    method_of,
    save_resolved,
)
from megarl.trainer.method_runtime import MethodRuntime
from megarl.trainer.metrics import MetricsWriter
from megarl.trainer.run_claim import check_run_dir, claim_run_dir
from megarl.trainer.setup import load_datasets, log, tokenizer_and_hf_config


class Run:
    """The assembled parts of one run (see the module docstring)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.logging.run_dir)
        self.engine: Any = None
        self.server: Any = None
        self.ref = None
        self.producer: Any = None
        self.resumed_from: Path | None = None  # the run checkpoint this run resumed from

    # ------------------------------------------------------------------------------ phases
    def setup(self) -> None:
        """Tokenizer, datasets, process groups, run directory, rewards (rank 0), sampler."""
        from megarl.data.dataset import PromptSampler
        from megarl.learner.parallel import ParallelLayout, init_distributed, initialize_parallel

        cfg = self.cfg
        self.tok, self.hf = tokenizer_and_hf_config(cfg)
        check_layout(cfg, self.hf, int(os.environ.get("WORLD_SIZE", "1")))
        self.train_ds, self.eval_ds = load_datasets(cfg, self.tok)
        check_run_dir(cfg)  # every rank refuses a used run_dir alike, before anything is written
        init_distributed()
        self.rank0 = dist.get_rank() == 0
        self.run_id = claim_run_dir(cfg, log) if self.rank0 else None
        if self.rank0:
            save_resolved(cfg, self.run_dir)
        dist.barrier()  # the run directory is settled before any rank looks into it
        p = cfg.parallel
        self.groups = initialize_parallel(
            ParallelLayout(
                tp=p.tp,
                pp=p.pp,
                ep=p.ep,
                cp=p.cp,
                sequence_parallel=p.sequence_parallel,
                expert_tp=p.expert_tp,
            ),
            seed=cfg.model.seed,
        )
        self.rewards = RewardComputer(cfg.reward) if self.rank0 else None
        self.metrics = MetricsWriter.from_config(self.run_dir, cfg, self.run_id) if self.rank0 else None
        self.sampler = PromptSampler(len(self.train_ds), cfg.schedule.seed)
        self.spec = method_of(cfg)
        self.method_knobs = method_knobs(cfg, self.spec)

    def initial_policy(self) -> tuple[Path | None, Path]:
        """(the checkpoint to resume from or None, the initial policy's directory); warms up first
        when neither exists (collective)."""
        from megarl.trainer.warmup import run_warmup

        ckpt = self._resume_checkpoint() if self.cfg.checkpoint.resume == "auto" else None
        init_dir = self.run_dir / INIT_POLICY
        if ckpt is None and not init_dir.is_dir():
            run_warmup(self, init_dir)
        dist.barrier()
        self.init_dir = init_dir
        return ckpt, init_dir

    def _resume_checkpoint(self) -> Path | None:
        """Rank 0 picks the newest complete checkpoint of this run; every rank gets it (or the error)."""
        pick: list = [None]
        if self.rank0:
            try:
                pick[0] = (resume_checkpoint(self.run_dir, self.run_id, log), None)
            except ForeignCheckpointError as e:
                pick[0] = (None, str(e))
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(pick, src=0)
        ckpt, error = pick[0]
        if error:
            raise ForeignCheckpointError(error)
        return ckpt

    def build_learners(self, init_dir: Path) -> None:
        """The policy learner holding ``init_dir``, the learner-side method parts, the objective."""
        from megarl.objectives.rl_objective import build_objective, objective_heads

        # output heads the objective's parts read are built into the policy model
        self.learner = self.make_learner(self.hf, heads=objective_heads(self.cfg.objective))
        self.learner.load_hf(str(init_dir))
        try:
            self.method = MethodRuntime.build_learner_side(self.context(), self.spec)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # one objective for the whole run: stateful parts accumulate across steps and checkpoints
        self.objective = build_objective(self.cfg.objective)

    def build_engine(self) -> None:
        """Rank 0's rollout engine and the event loop engine calls run on."""
        from megarl.trainer.servers import make_on_rank0

        r = self.cfg.rollout
        self.engine = make_on_rank0(self._make_engine, r.server_startup_timeout_s if r.launch else None)
        self.loop = self.make_event_loop()

    def build_rank0_parts(self, wrap_engine: Any = None) -> None:
        """Round processors and the method's own parts, then (rank 0) the rollout collector over
        ``wrap_engine(engine)`` (the asynchronous loop's gated engine) or the engine itself."""
        from megarl.rollout.workflow import WORKFLOWS, WorkflowContext
        from megarl.trainer.allocation import allocator_from_config
        from megarl.trainer.collector import LockedRewards, RolloutCollector

        cfg = self.cfg
        if self.rank0 and not isinstance(self.rewards, LockedRewards):
            self.rewards = LockedRewards(self.rewards)
        engine = self.engine if wrap_engine is None or self.engine is None else wrap_engine(self.engine)
        try:
            self.method.build_rank0_side(self.context(engine), self.spec, self.method_knobs)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.collector = None
        if not self.rank0:
            return
        if self.method.allocator is not None and cfg.sampling.dynamic:
            raise ConfigError(
                f"sampling.dynamic=true and method {self.spec.name!r} brings its own rollout allocator; "
                "set sampling.dynamic: false"
            )

        def score(text: str, answer: str) -> tuple[float, bool]:
            res = self.rewards([text], [answer])
            return float(res.scalar[0]), res.correct is not None and bool(res.correct[0])

        wctx = WorkflowContext(
            self.tok,
            score,
            int(self.hf.get("max_position_embeddings", 0)) or None,
            cfg.environment,
            parts=self.method.workflow_parts,
        )
        version = (lambda: self.producer.version) if wrap_engine is not None else (lambda: 0)
        self.collector = RolloutCollector(
            engine=engine,
            tokenizer=self.tok,
            dataset=self.train_ds,
            sampler=self.sampler,
            rewards=self.rewards,
            workflow=WORKFLOWS.get(cfg.environment.name)(wctx),
            processors=self.method.round_processors,
            allocator=self.method.allocator or allocator_from_config(cfg),
            sampling=self.sampling_params,
            n=cfg.rollout.n,
            weights={f.name: float(f.weight) for f in cfg.reward.functions},
            fallback=cfg.reward.fallback,
            version=version,
            log=log,
        )

    def build_faults(self) -> None:
        """Injections, detectors, the non-finite guard and step dumps (docs/faults.md)."""
        from megarl.faults.monitor import FaultMonitor
        from megarl.rundir import read_metrics
        from megarl.trainer.config import to_dict

        self.faults = FaultMonitor(
            self.cfg.faults,
            self.learner,
            self.groups,
            self.run_dir,
            self.hf,
            to_dict(self.cfg),
            read_metrics(self.run_dir),
        )

    # ------------------------------------------------------------------------------ helpers
    def context(self, engine: Any = None) -> RunContext:
        """The ``RunContext`` parts are built with."""
        return RunContext(
            cfg=self.cfg,
            tokenizer=self.tok,
            hf_config=self.hf,
            rank0=self.rank0,
            init_dir=self.run_dir / INIT_POLICY,
            make_learner=self._make_loaded_learner,
            policy=getattr(self, "learner", None),
            engine=engine,
            score=self.rewards,
            sampling=self.sampling_params,
            groups=getattr(self, "groups", None),
            dp_share=self.dp_share,
            dp_group=self.dp_group() if hasattr(self, "groups") else None,
            push_weights=self.push_weights,
            run_coroutine=self.run_coroutine,
            dataset=getattr(self, "train_ds", None),
        )

    def run_coroutine(self, coro: Any) -> Any:
        """``coro`` run to completion on the engine's event loop."""
        return self.loop.run_until_complete(coro)

    def push_weights(self, label: str, learner: Any = None) -> None:
        """The learner's (or ``learner``'s) current weights -> rank 0's engine as version ``label``
        (collective)."""
        from megarl.trainer.weights import push_weights

        push_weights(self, label, learner)

    def make_learner(
        self, hf_config: dict, trainable: bool = True, lr: float | None = None, heads: tuple[str, ...] = ()
    ):
        """A learner under the run's layout with the run's optimizer and precision settings
        (``heads``: extra output heads on its final hidden states, megarl/learner/heads.py)."""
        c = self.cfg
        return build_learner(
            hf_config,
            self.groups,
            c.optimizer,
            c.model.params_dtype,
            c.model.seed,
            trainable=trainable,
            lr=lr,
            fused_output=c.model.fused_output,
            heads=heads,
        )

    def _make_loaded_learner(self, hf_config: dict, weights_dir: str | Path, trainable: bool = False):
        ln = self.make_learner(hf_config, trainable=trainable)
        ln.load_hf(str(weights_dir))
        return ln

    def make_event_loop(self) -> Any:
        """The loop every engine call runs on (``run_until_complete``)."""
        return asyncio.new_event_loop()

    def _make_engine(self):
        r = self.cfg.rollout
        if r.engine == "embedded":
            from megarl.rollout.embedded import EmbeddedEngine, hf_model_from_config

            return EmbeddedEngine(
                hf_model_from_config(self.hf),
                eos_token_ids=[self.tok.eos_id],
                max_concurrency=r.max_concurrency,
                weight_version="init",
                max_batch_rows=r.embedded_batch_rows,
            )
        if r.launch:  # one vLLM or SGLang server on this node serving the initial policy (stopped at exit)
            from megarl.trainer.servers import launch_server_for_run

            self.server, engine = launch_server_for_run(
                self.cfg, self.run_dir / INIT_POLICY, self.run_dir, self.hf, log
            )
            return engine
        from megarl.trainer.servers import connect_servers

        return connect_servers(r, log, vocab_size=int(self.hf["vocab_size"]))

    def dp_group(self):
        """The data-parallel group (None with one replica)."""
        return self.groups.dp if self.groups.dp_size > 1 else None

    def dp_share(self, batch: PackedBatch) -> PackedBatch:
        """This data-parallel replica's contiguous share of whole groups."""
        dp = self.groups.dp_size
        if dp == 1:
            return batch
        gids = torch.unique(batch.group_ids).tolist()
        per = len(gids) // dp
        mine = set(gids[self.groups.dp_rank * per : (self.groups.dp_rank + 1) * per])
        return batch.select([i for i, g in enumerate(batch.group_ids.tolist()) if g in mine])

    def sampling_params(self, step: int, rnd: int, i: int, greedy: bool = False):
        """The seeded sampling parameters of prompt ``i`` of round ``rnd`` of ``step``."""
        from megarl.rollout.types import SamplingParams

        r = self.cfg.rollout
        seed = (self.cfg.schedule.seed * 1_000_003 + step * 10_007 + rnd * 101 + i) % (2**31)
        return SamplingParams(
            temperature=0.0 if greedy else r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=(self.tok.eos_id,),
            seed=seed,
        )
