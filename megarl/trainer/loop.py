"""The synchronous RL loop.

One step::

    prompts (seeded sampler) -> rollouts, n per prompt (engine, current weights)
      -> rewards (named dimensions, contained user functions)
      -> [dynamic sampling: drop zero-variance groups, sample more prompts]
      -> old logprobs (learner, forward only) and ref logprobs (frozen reference learner) as needed
      -> advantages (whole batch of complete groups)
      -> ppo_epochs x mini_batches optimizer steps (learner.train_step, micro-batched)
      -> weight sync to the engine -> metrics -> checkpoint

Rank 0 drives the engine and the rewards; the batch is broadcast to every rank, each data-parallel
replica trains on its share of the groups. Sampling seeds are derived from (seed, step, prompt), so a
resumed run draws the same samples as an uninterrupted one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megarl.batch import PackedBatch, from_sequences
from megarl.data.dataset import PromptDataset, PromptRow, PromptSampler, load_jsonl_rows
from megarl.data.tokenizer import CharTokenizer
from megarl.objectives.api import GlobalNormalisers
from megarl.rewards.compute import RewardComputer
from megarl.trainer import checkpointing
from megarl.trainer.config import ConfigError, TrainConfig, check_layout, save_resolved
from megarl.trainer.method_inputs import MethodInputs
from megarl.trainer.metrics import MetricsWriter, Progress, read_metrics
from megarl.trainer.policy import SFTObjective, build_learner, export_state, hf_model_from_config

INIT_POLICY = "init_policy"  # run_dir/init_policy: HF weights after warm-up (the RL start and the KL reference)


@dataclass
class Rollouts:
    """The samples of one step, on rank 0 (plain lists, picklable for the broadcast)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logprobs: list[list[float]]
    group_ids: list[int]
    task_ids: list[int]
    truncated: list[bool]
    rewards: list[float]
    reward_dims: dict[str, list[float]]
    responses: list[str]
    answers: list[str] = field(default_factory=list)  # ground truth per sample (DASH checkpoints)
    extras: dict[str, list[float]] = field(default_factory=dict)  # per-sample method inputs (rrpo_scores)
    response_masks: list = field(default_factory=list)  # multi-turn: per sample [R] 1 on answer tokens
    turn_spans: list = field(default_factory=list)  # multi-turn: per sample [(start, end, role)]


def _log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


class Trainer:
    """Builds everything from a ``TrainConfig`` and runs the loop (``run``)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.logging.run_dir)
        self._stop_signal: Optional[int] = None

    # ------------------------------------------------------------------------------------ setup
    def _tokenizer_and_hf_config(self) -> tuple[object, dict]:
        m = self.cfg.model
        if m.hf_dir is not None:
            from megarl.learner.model import load_hf_config

            hf = load_hf_config(m.hf_dir)
        else:
            hf = dict(m.hf_config)
        if m.tokenizer == "char":
            tok = CharTokenizer(m.alphabet)
            if hf.get("vocab_size", tok.vocab_size) < tok.vocab_size:
                raise ConfigError(f"model.hf_config.vocab_size={hf['vocab_size']} is smaller than the char "
                                  f"tokenizer's {tok.vocab_size}")
            hf.setdefault("vocab_size", tok.vocab_size)
            hf.update(eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id)
        else:
            if m.hf_dir is None:
                raise ConfigError("model.tokenizer='hf' needs model.hf_dir (a tokenizer.json beside the weights)")
            from transformers import AutoTokenizer

            tok = _HFTokenizer(AutoTokenizer.from_pretrained(m.hf_dir))
        return tok, hf

    def _load_data(self, tok) -> tuple[PromptDataset, Optional[PromptDataset]]:
        d = self.cfg.data
        if d.generate:
            from megarl.data.tasks import generate_task_files

            g = dict(d.generate)
            if not d.train or not d.eval:
                raise ConfigError("data.generate needs data.train and data.eval (the files it writes)")
            if not (os.path.exists(d.train) and os.path.exists(d.eval)):
                try:
                    generate_task_files(train_path=d.train, eval_path=d.eval, **g)
                except (TypeError, ValueError) as e:
                    raise ConfigError(f"data.generate: {e}; allowed keys: task, num_train, num_eval, digits, seed") \
                        from None
        check = lambda text: tok.encode(text)  # noqa: E731 - raises ValueError on an unknown character
        chat = None
        if d.chat_template:
            from megarl.data.chat import chat_renderer

            chat = chat_renderer(tok, d.system_prompt)

        def load(path: str) -> PromptDataset:
            rows, bad = load_jsonl_rows(path, d.prompt_field, d.answer_field, d.task_field, d.prompt_template,
                                        check, d.on_bad_row, d.max_bad_rows, chat=chat)
            for b in bad[:5]:
                _log(f"megarl train: skipped bad row {b}")
            if bad:
                _log(f"megarl train: skipped {len(bad)} bad row(s) in {path}")
            return PromptDataset(rows, bad)

        return load(d.train), (load(d.eval) if d.eval else None)

    def _install_signal_handlers(self) -> None:
        def handler(signum, frame):
            self._stop_signal = signum
            _log(f"megarl train: got signal {signum}; checkpointing after this step, then exiting")

        for s in (signal.SIGTERM, signal.SIGUSR1):
            try:
                signal.signal(s, handler)
            except ValueError:  # not the main thread (tests)
                pass

    # ------------------------------------------------------------------------------------ run
    def run(self) -> int:
        cfg = self.cfg
        from megarl.learner.parallel import ParallelLayout, init_distributed, initialize_parallel

        tok, hf = self._tokenizer_and_hf_config()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        check_layout(cfg, hf, world)
        train_ds, eval_ds = self._load_data(tok)
        self.tok, self.hf = tok, hf
        self.train_ds, self.eval_ds = train_ds, eval_ds
        init_distributed()
        rank0 = dist.get_rank() == 0
        if rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_resolved(cfg, self.run_dir)
        p = cfg.parallel
        groups = initialize_parallel(ParallelLayout(tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp,
                                                    sequence_parallel=p.sequence_parallel, expert_tp=p.expert_tp),
                                     seed=cfg.model.seed)
        self.groups = groups
        self._install_signal_handlers()
        self.rewards = RewardComputer(cfg.reward) if rank0 else None
        self.metrics = MetricsWriter.from_config(self.run_dir, cfg) if rank0 else None
        self.sampler = PromptSampler(len(train_ds), cfg.schedule.seed)
        self.failures_total = {"errors": 0, "timeouts": 0}

        ckpt = checkpointing.latest_checkpoint(self.run_dir) if cfg.checkpoint.resume == "auto" else None
        init_dir = self.run_dir / INIT_POLICY
        if ckpt is None and not init_dir.is_dir():
            self._warmup(init_dir)
        dist.barrier()
        self._build_policy_and_method(init_dir)
        start = 0
        method_state: dict = {}
        if ckpt is not None:
            state = checkpointing.load(ckpt, self.learner)
            self.objective.load_state_dict(checkpointing.load_objective_state(ckpt))
            method_state = checkpointing.load_method_state(ckpt)
            self.method.load_state_dict(method_state.get("inputs", {}))
            start = int(state["step"])
            self.sampler.load_state_dict(state["sampler"])
            self.failures_total = state.get("reward_failures", self.failures_total)
            if rank0:
                self.metrics.truncate_after(start)
            _log(f"megarl train: resumed from {ckpt} (step {start})")
        elif rank0 and self.metrics.path.exists():
            self.metrics.truncate_after(0)
        from megarl.trainer.servers import make_on_rank0

        launch_wait = cfg.rollout.server_startup_timeout_s if cfg.rollout.launch else None
        self.engine = make_on_rank0(self._make_engine, launch_wait)
        self.loop = self._make_event_loop()
        self.shaping, self.rrpo = self._rank0_methods(method_state) if rank0 else (None, None)
        from megarl.faults.monitor import FaultMonitor
        from megarl.trainer.config import to_dict

        # injections, detectors, the non-finite guard and step dumps (docs/faults.md)
        self.faults = FaultMonitor(cfg.faults, self.learner, groups, self.run_dir, hf, to_dict(cfg),
                                   read_metrics(self.run_dir))
        self._sync_weights(version=start)
        if start == 0 and rank0 and not any(r.get("step") == 0 for r in read_metrics(self.run_dir)):
            rec = {"step": 0, **self._evaluate()}
            self.metrics.write(rec)
            _log(f"step    0/{cfg.schedule.steps} (initial policy){_eval_text(rec)}")
        progress = Progress(cfg.schedule.steps, start, cfg.logging.progress)
        code = 0
        for step in range(start + 1, cfg.schedule.steps + 1):
            rec = self._step(step)
            last = step == cfg.schedule.steps
            if rank0 and (last or (cfg.schedule.eval_every and step % cfg.schedule.eval_every == 0)):
                rec.update(self._evaluate())
            if rank0:
                self.metrics.write(rec)
                if step % cfg.logging.print_every == 0 or last:
                    _log(progress.line(step, rec) + _eval_text(rec))
            stop = self._stop_signal is not None
            if last or step % cfg.checkpoint.every == 0 or stop:
                self._checkpoint(step)
            if stop:
                code = 128 + int(self._stop_signal)
                break
        self._finish()
        return code

    # ------------------------------------------------------------------------------------ pieces
    def _make_event_loop(self):
        """The loop every engine call runs on (``run_until_complete``); the async loop's runs in a thread."""
        return asyncio.new_event_loop()

    def _build_policy_and_method(self, init_dir: Path) -> None:
        """The learner and (when a method needs it) the frozen reference, both holding the initial
        policy ``init_dir``; the method inputs and the objective, each made once per run."""
        from megarl.objectives.rl_objective import build_objective

        cfg = self.cfg
        self.learner = build_learner(cfg, self.hf, self.groups)
        self.learner.load_hf(str(init_dir))
        # what the configured methods need beyond the core batch (entropies, reference, steps, ...)
        # and the advantage estimator's state (GEPO's history): one per run, like the objective
        self.method = MethodInputs(cfg)
        self.ref = None
        if self.method.needs_ref:
            self.ref = build_learner(cfg, self.hf, self.groups, trainable=False)
            self.ref.load_hf(str(init_dir))
        self.teacher = None
        if self.method.needs_teacher:  # on-policy distillation: forward-only, its own architecture
            from megarl.trainer.method_inputs import teacher_hf_config

            self.teacher = build_learner(cfg, teacher_hf_config(cfg, self.hf), self.groups, trainable=False)
            self.teacher.load_hf(cfg.teacher.hf_dir)
        # one objective for the whole run: stateful parts (EPPO's task entropies, ...) accumulate
        # across steps and travel with the checkpoints
        self.objective = build_objective(cfg.objective)

    def _rank0_methods(self, state: dict) -> tuple:
        """Rank 0's reward shaper (``reward.shaping``, LLM judges over the run's engine) and RRPO
        scorer, each with its checkpointed state; (None, None) when the config has neither."""
        cfg = self.cfg
        shaping = rrpo = None
        if cfg.reward.shaping is not None:
            from megarl.trainer.shaping import JudgeTokenizer, RewardShaping

            judge = None
            if cfg.reward.shaping["name"] in ("cedar", "care"):
                from megarl.rewards.shaping.judge import LLMJudge
                from megarl.rollout.types import SamplingParams

                j = cfg.reward.judge
                room = int(self.hf.get("max_position_embeddings", 4096)) - j.max_new_tokens - 1
                judge = LLMJudge(self.engine, JudgeTokenizer(self.tok, room), timeout_s=j.timeout_s,
                                 sampling=SamplingParams(temperature=j.temperature, max_new_tokens=j.max_new_tokens,
                                                         stop_token_ids=(self.tok.eos_id,)))

            def score_anchor(answer: str) -> dict[str, float]:
                return {k: float(v[0]) for k, v in self.rewards([answer], [answer]).dims.items()}

            shaping = RewardShaping(cfg, self.loop.run_until_complete, judge, score_anchor)
            if "shaping" in state:
                shaping.load_state_dict(state["shaping"])
        if self.method.needs_rrpo_scores:
            from megarl.trainer.rrpo_scores import RRPOScorer

            if cfg.rollout.engine != "embedded":
                raise ConfigError("advantage.estimator=rrpo needs rollout.engine: embedded (the anchors and "
                                  "rollouts are embedded with the engine's in-process model)")
            rrpo = RRPOScorer(cfg, int(self.hf["hidden_size"]), cfg.model.seed)
            if "rrpo" in state:
                rrpo.load_state_dict(state["rrpo"])
        return shaping, rrpo

    def _method_state(self) -> dict:
        """Everything method-specific a checkpoint must hold besides the objective (rank 0's view)."""
        st: dict = {"inputs": self.method.state_dict()}
        if getattr(self, "shaping", None) is not None:
            st["shaping"] = self.shaping.state_dict()
        if getattr(self, "rrpo", None) is not None:
            st["rrpo"] = self.rrpo.state_dict()
        return st

    def _shape_round(self, rr, rows: list[PromptRow], uids: list[int], prompts: list[list[int]],
                     resp_ids: list[list[int]], texts: list[str], n: int, step: int, rnd: int
                     ) -> tuple[torch.Tensor, dict[str, list[float]], dict[str, float]]:
        """Rank 0, one rollout round: shaped scalar rewards [G*n], per-sample extras, metrics."""
        scalar, extras, metrics = rr.scalar, {}, {}
        # getattr: trainers assembled piecemeal (tests of the rollout phase) have no method parts
        shaping, rrpo = getattr(self, "shaping", None), getattr(self, "rrpo", None)
        if shaping is not None:
            from megarl.trainer.shaping import RoundRewards

            out = shaping.shape(RoundRewards([r.prompt for r in rows], [r.answer for r in rows], uids, texts,
                                                  rr.dims, rr.scalar, n), step)
            scalar, metrics = out.scalar, dict(out.metrics)
        if rrpo is not None:
            scores, m = rrpo.scores(self.engine.model, self.engine, self.loop.run_until_complete, self.tok,
                                         prompts, [r.prompt for r in rows], [r.answer for r in rows], resp_ids, n,
                                         self._sampling_params(step, rnd + 1000, 0))
            extras["rrpo_scores"] = scores
            metrics.update(m)
        return scalar, extras, metrics

    def _play_episodes(self, rows: list[PromptRow], n: int, step: int, rnd: int):
        """Rank 0, ``environment`` set: ``n`` multi-turn episodes per prompt through the engine
        (megarl/trainer/multiturn.py); returns (prompt ids, per-prompt groups of episode samples)."""
        import dataclasses

        from megarl.trainer.multiturn import play_groups

        env = self.cfg.environment
        best = float(sum(f.weight for f in self.cfg.reward.functions if f.weight > 0)) or 1.0

        def sampling(g: int, j: int):
            sp = self._sampling_params(step, rnd, g)
            return dataclasses.replace(sp, seed=(sp.seed * 31 + j) % (2 ** 31))

        def score(text: str, g: int) -> float:
            return float(self.rewards([text], [rows[g].answer]).scalar[0])

        groups = self.loop.run_until_complete(play_groups(
            self.engine, self.tok, [r.prompt for r in rows], n, sampling, score, best, env.max_turns, env.feedback,
            int(self.hf.get("max_position_embeddings", 0)) or None))
        return [self.tok.encode(r.prompt) for r in rows], groups

    def _make_engine(self):
        r = self.cfg.rollout
        if r.engine == "embedded":
            from megarl.rollout.embedded import EmbeddedEngine

            return EmbeddedEngine(hf_model_from_config(self.hf), eos_token_ids=[self.tok.eos_id],
                                  max_concurrency=r.max_concurrency, weight_version="init")
        if r.launch:  # one vLLM server on this node, serving the initial policy (stopped at exit)
            from megarl.trainer.servers import launch_vllm_for_run

            self.server, engine = launch_vllm_for_run(self.cfg, self.run_dir / INIT_POLICY, self.run_dir,
                                                      self.hf, _log)
            return engine
        from megarl.rollout import make_engine

        return make_engine(r.urls, kind=r.engine)

    def _sync_weights(self, version: int) -> None:
        """Weights of the learner -> the engine (collective: every rank takes part in the export)."""
        r = self.cfg.rollout
        if r.engine == "embedded":
            state = export_state(self.learner)
            if self.engine is not None:
                self.loop.run_until_complete(self.engine.update_weights_from_tensors(state, str(version)))
            return
        from megarl.convert.hf_megatron import save_hf_checkpoint

        wdir = Path(r.weights_dir or self.run_dir / "weights") / f"v{version:06d}"
        if dist.get_rank() == 0 and wdir.exists():
            import shutil

            shutil.rmtree(wdir)
        dist.barrier()
        save_hf_checkpoint(self.learner.model, self.groups, wdir, hf_config=self.hf)
        if self.engine is not None:
            self.loop.run_until_complete(self.engine.update_weights(str(wdir), str(version)))

    def _warmup(self, init_dir: Path) -> None:
        """Supervised warm-up on the training answers; writes the initial policy (HF safetensors)."""
        from megarl.convert.hf_megatron import save_hf_checkpoint

        cfg, w = self.cfg, self.cfg.warmup
        ln = build_learner(cfg, self.hf, self.groups, lr=w.lr)
        if cfg.model.hf_dir is not None:
            ln.load_hf(cfg.model.hf_dir)
        sampler = PromptSampler(len(self.train_ds), cfg.schedule.seed + 7)
        obj = SFTObjective()
        t0 = time.time()
        for s in range(1, w.sft_steps + 1):
            rows = [self.train_ds.rows[i] for i in sampler.next_indices(w.batch_size)]
            batch = self._sft_batch(rows)
            m = ln.train_step(self._dp_share(batch), obj, 1, GlobalNormalisers.from_batch(
                self._dp_share(batch), self._dp_group()))
            if s % 10 == 0 or s == w.sft_steps:
                _log(f"warm-up {s:>3}/{w.sft_steps}  nll {m['nll']:.3f}  ({time.time() - t0:.1f}s)")
        tmp = init_dir.with_name(init_dir.name + ".tmp-megarl")
        if dist.get_rank() == 0 and tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        dist.barrier()
        save_hf_checkpoint(ln.model, self.groups, init_dir, hf_config=self.hf)
        del ln

    def _sft_batch(self, rows: list[PromptRow]) -> PackedBatch:
        P = [self.tok.encode(r.prompt) for r in rows]
        R = [self.tok.encode(r.answer, bos=False) + [self.tok.eos_id] for r in rows]
        return from_sequences(P, R, list(range(len(rows))))

    def _dp_group(self):
        return self.groups.dp if self.groups.dp_size > 1 else None

    def _dp_share(self, batch: PackedBatch) -> PackedBatch:
        """This data-parallel replica's contiguous share of whole groups."""
        dp = self.groups.dp_size
        if dp == 1:
            return batch
        gids = torch.unique(batch.group_ids).tolist()
        per = len(gids) // dp
        mine = set(gids[self.groups.dp_rank * per:(self.groups.dp_rank + 1) * per])
        return batch.select([i for i, g in enumerate(batch.group_ids.tolist()) if g in mine])

    def _sampling_params(self, step: int, rnd: int, i: int, greedy: bool = False):
        from megarl.rollout.types import SamplingParams

        r = self.cfg.rollout
        seed = (self.cfg.schedule.seed * 1_000_003 + step * 10_007 + rnd * 101 + i) % (2 ** 31)
        return SamplingParams(temperature=0.0 if greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=(self.tok.eos_id,), seed=seed)

    def _generate(self, rows: list[PromptRow], n: int, step: int, rnd: int, greedy: bool = False):
        prompts = [self.tok.encode(r.prompt) for r in rows]

        async def go():
            return await asyncio.gather(*[
                self.engine.generate(p, n=n, sampling=self._sampling_params(step, rnd, i, greedy))
                for i, p in enumerate(prompts)])

        return prompts, self.loop.run_until_complete(go())

    def _rollout(self, step: int) -> tuple[Rollouts, dict]:
        """Rank 0: sample prompts, generate, score; dynamic sampling when enabled."""
        cfg = self.cfg
        n, want = cfg.rollout.n, cfg.schedule.prompts_per_step
        out = Rollouts([], [], [], [], [], [], [], {k: [] for k in self.rewards.names}, [])
        stats = {"gen_tokens": 0, "gen_time": 0.0, "reward_time": 0.0, "groups_seen": 0, "groups_zero_var": 0,
                 "rounds": 0, "errors": 0, "timeouts": 0}
        rnd = 0
        while True:
            need = want - len(set(out.group_ids))
            uids = list(self.sampler.next_indices(need))
            rows = [self.train_ds.rows[i] for i in uids]
            t0 = time.time()
            multi_turn = cfg.environment.name != "none"
            prompts, results = (self._play_episodes(rows, n, step, rnd) if multi_turn
                                else self._generate(rows, n, step, rnd))
            stats["gen_time"] += time.time() - t0
            t0 = time.time()
            answers, resp_ids, resp_lp, trunc, texts, masks, spans = [], [], [], [], [], [], []
            for row, res in zip(rows, results):
                for s in res.samples:
                    resp_ids.append(list(s.token_ids))
                    resp_lp.append(list(s.logprobs))
                    trunc.append(s.truncated if multi_turn else s.finish_reason == "length")
                    # an episode is scored on its last answer; its observations are not in the loss
                    texts.append(s.text if multi_turn else self.tok.decode(s.token_ids))
                    masks.append(s.loss_mask if multi_turn else None)
                    spans.append(s.turn_spans if multi_turn else None)
                    answers.append(row.answer)
                    stats["gen_tokens"] += len(s.token_ids)
            rr = self.rewards(texts, answers)
            shaped, round_extras, method_metrics = self._shape_round(rr, rows, uids, prompts, resp_ids, texts, n,
                                                                     step, rnd)
            stats.setdefault("method", {}).update(method_metrics)
            stats["reward_time"] += time.time() - t0
            stats["errors"] += rr.errors
            stats["timeouts"] += rr.timeouts
            for f in rr.failures[:2]:
                _log(f"megarl train: reward failure contained ({f}); fallback {cfg.reward.fallback}")
            for gi, (row, p) in enumerate(zip(rows, prompts)):
                sl = slice(gi * n, (gi + 1) * n)
                vals = shaped[sl]
                stats["groups_seen"] += 1
                zero_var = bool((vals == vals[0]).all())
                stats["groups_zero_var"] += int(zero_var)
                if cfg.sampling.dynamic and zero_var:
                    continue
                gid = len(set(out.group_ids))
                out.prompt_ids += [p] * n
                out.response_ids += resp_ids[sl]
                out.rollout_logprobs += resp_lp[sl]
                out.group_ids += [gid] * n
                out.task_ids += [self.train_ds.task_id[row.task]] * n
                out.truncated += trunc[sl]
                out.rewards += vals.tolist()
                out.responses += texts[sl]
                out.answers += [row.answer] * n
                if multi_turn:
                    out.response_masks += masks[sl]
                    out.turn_spans += spans[sl]
                for k, v in round_extras.items():
                    out.extras.setdefault(k, []).extend(v[sl])
                for k in out.reward_dims:
                    out.reward_dims[k] += rr.dims[k][sl].tolist()
            rnd += 1
            stats["rounds"] = rnd
            if not cfg.sampling.dynamic or len(set(out.group_ids)) >= want or rnd >= cfg.sampling.max_rounds:
                break
        return out, stats

    def _batch(self, ro: Rollouts, step: int) -> PackedBatch:
        lp = []
        for p, r_lp in zip(ro.prompt_ids, ro.rollout_logprobs):
            lp += [0.0] * len(p) + [min(x, 0.0) for x in r_lp]
        B = len(ro.group_ids)
        batch = from_sequences(ro.prompt_ids, ro.response_ids, ro.group_ids,
                              rewards=torch.tensor(ro.rewards, dtype=torch.float32),
                              task_ids=torch.tensor(ro.task_ids, dtype=torch.long),
                              policy_versions=torch.full((B,), step - 1, dtype=torch.long),
                              truncated=torch.tensor(ro.truncated, dtype=torch.bool),
                              rollout_logprobs=torch.tensor(lp, dtype=torch.float32))
        if ro.turn_spans:  # multi-turn episodes: observations out of the loss, the turn structure kept
            from megarl.trainer.multiturn import apply_episode_structure

            apply_episode_structure(batch, ro.response_masks, ro.turn_spans)
        return batch

    def _step(self, step: int) -> dict:
        cfg = self.cfg
        rank0 = dist.get_rank() == 0
        t_step = time.time()
        payload = [None]
        if rank0:
            ro, rstats = self._rollout(step)
            payload = [(ro, rstats)]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)
        ro, rstats = payload[0]
        rec: dict = {"step": step}
        if not ro.group_ids:
            _log(f"step {step}: every group had equal rewards (dynamic sampling); no update this step")
            rec.update(self._rollout_metrics(ro, rstats))
            self._sync_weights(version=step)
            return rec
        batch = self._batch(ro, step)
        t0 = time.time()
        want_ent = self.method.needs_entropies  # GEPO, EPPO: the behaviour policy's full-vocab entropy
        if cfg.schedule.old_logprobs == "recompute" or want_ent:
            lp, batch.entropies = self.learner.compute_logprobs(batch, cfg.schedule.micro_batches,
                                                                with_entropy=want_ent)
            if cfg.schedule.old_logprobs == "recompute":
                batch.old_logprobs = lp
        if self.ref is not None:
            batch.ref_logprobs, _ = self.ref.compute_logprobs(batch, cfg.schedule.micro_batches)
        if getattr(self, "teacher", None) is not None:
            batch.teacher_logprobs, _ = self.teacher.compute_logprobs(batch, cfg.schedule.micro_batches)
        t_logprob = time.time() - t0
        self.method.fill_batch(batch, self.tok, ro.answers, ro.reward_dims, ro.extras)
        self.method.advantages(batch)
        rec.update(self.method.metrics(batch))
        objective = self.objective
        t0 = time.time()
        train_metrics: list[dict] = []
        gids = torch.unique(batch.group_ids).tolist()
        for _epoch in range(cfg.schedule.ppo_epochs):
            nmb = min(cfg.schedule.mini_batches, len(gids))
            bounds = torch.linspace(0, len(gids), nmb + 1).round().long().tolist()
            for a, b in zip(bounds[:-1], bounds[1:]):
                keep = set(gids[a:b])
                mb = batch.select([i for i, g in enumerate(batch.group_ids.tolist()) if g in keep])
                local = self._dp_share(mb)
                # L_max of seq-mean-token-sum-norm is the generation budget (Dr.GRPO's constant)
                norms = GlobalNormalisers.from_batch(local, self._dp_group(), cfg.rollout.max_new_tokens)
                micro = max(1, min(cfg.schedule.micro_batches, local.num_seqs))
                local = self.faults.before_train(step, local, objective, micro, norms)
                train_metrics.append(self.learner.train_step(local, objective, micro, norms))
                self.faults.after_train(step, train_metrics[-1])
        t_train = time.time() - t0
        t0 = time.time()
        self._sync_weights(version=step)
        t_sync = time.time() - t0
        last = train_metrics[-1]
        for k in last:
            rec[f"train/{k}"] = sum(m[k] for m in train_metrics) / len(train_metrics)
        rec["train/optimizer_steps"] = len(train_metrics)
        rec.update(self._rollout_metrics(ro, rstats))
        adv = batch.advantages[batch.loss_mask.bool()]
        rec.update({"adv/mean": float(adv.mean()), "adv/std": float(adv.std()) if adv.numel() > 1 else 0.0,
                    "adv/abs_max": float(adv.abs().max())})
        if batch.old_logprobs is not None:
            m = batch.loss_mask.bool()
            # the same weights on both sides: a check of the weight sync and of the two forwards
            rec["rollout/logprob_gap_old"] = float((batch.old_logprobs[m] - batch.rollout_logprobs[m]).abs().mean())
        if batch.ref_logprobs is not None and batch.old_logprobs is not None:
            m = batch.loss_mask.bool()
            rec["rollout/kl_old_ref"] = float((batch.old_logprobs[m] - batch.ref_logprobs[m]).mean())
        train_tokens = batch.num_tokens * cfg.schedule.ppo_epochs
        rec.update({"time/rollout": rstats["gen_time"], "time/reward": rstats["reward_time"],
                    "time/logprob": t_logprob, "time/train": t_train, "time/sync": t_sync,
                    "perf/train_tokens_per_s": train_tokens / max(t_train, 1e-9),
                    "time/step": time.time() - t_step})
        rec.update(self.faults.end_step(step, rec))
        return rec

    def _rollout_metrics(self, ro: Rollouts, rs: dict) -> dict:
        self.failures_total["errors"] += rs["errors"]
        self.failures_total["timeouts"] += rs["timeouts"]
        rec: dict = {}
        if ro.rewards:
            r = torch.tensor(ro.rewards)
            rec.update({"reward/mean": float(r.mean()), "reward/std": float(r.std()) if r.numel() > 1 else 0.0})
            for k, v in ro.reward_dims.items():
                t = torch.tensor(v)
                rec[f"reward/{k}/mean"] = float(t.mean())
                rec[f"reward/{k}/std"] = float(t.std()) if t.numel() > 1 else 0.0
            lens = torch.tensor([len(x) for x in ro.response_ids], dtype=torch.float32)
            rec.update({"rollout/response_len": float(lens.mean()), "rollout/response_len_max": float(lens.max()),
                        "rollout/truncated_frac": float(torch.tensor(ro.truncated, dtype=torch.float32).mean()),
                        "rollout/samples": len(ro.rewards)})
            rec["rollout/example"] = ro.responses[0]
        rec.update({"rollout/zero_var_group_frac": rs["groups_zero_var"] / max(rs["groups_seen"], 1),
                    "rollout/groups_seen": rs["groups_seen"], "rollout/sampling_rounds": rs["rounds"],
                    "perf/rollout_tokens_per_s": rs["gen_tokens"] / max(rs["gen_time"], 1e-9),
                    "reward/fn_errors": rs["errors"], "reward/fn_timeouts": rs["timeouts"],
                    "reward/fn_errors_total": self.failures_total["errors"],
                    "reward/fn_timeouts_total": self.failures_total["timeouts"]})
        rec.update(rs.get("method", {}))
        return rec

    def _evaluate(self) -> dict:
        """Held-out pass@1 (greedy) and pass@k (k samples at the rollout temperature); rank 0 only."""
        if self.eval_ds is None:
            return {}
        s = self.cfg.schedule
        rows = self.eval_ds.rows[:s.eval_samples]
        t0 = time.time()
        _, greedy = self._generate(rows, 1, step=-1, rnd=0, greedy=True)
        texts = [self.tok.decode(g.samples[0].token_ids) for g in greedy]
        r1 = self.rewards(texts, [r.answer for r in rows]).scalar
        best = float(max(f.weight for f in self.cfg.reward.functions if f.weight > 0)) if any(
            f.weight > 0 for f in self.cfg.reward.functions) else 1.0
        out = {"eval/pass@1": float((r1 >= best).float().mean()), "eval/reward_greedy": float(r1.mean())}
        if s.eval_k > 1:
            _, samp = self._generate(rows, s.eval_k, step=-2, rnd=0)
            texts = [self.tok.decode(x.token_ids) for g in samp for x in g.samples]
            answers = [r.answer for r in rows for _ in range(s.eval_k)]
            rk = self.rewards(texts, answers).scalar.view(len(rows), s.eval_k)
            out[f"eval/pass@{s.eval_k}"] = float((rk >= best).any(1).float().mean())
            out["eval/sampled_acc"] = float((rk >= best).float().mean())
        out["time/eval"] = time.time() - t0
        return out

    def _trainer_state(self, step: int) -> dict:
        """What ``trainer.json`` holds besides the step and the RNG (subclasses add their own)."""
        return {"sampler": self.sampler.state_dict(), "reward_failures": self.failures_total,
                "policy_version": step}

    def _checkpoint(self, step: int) -> None:
        t0 = time.time()
        state = self._trainer_state(step)
        path = checkpointing.save(self.run_dir, step, self.learner, state, self.cfg.checkpoint.keep_last,
                                  objective_state=self.objective.state_dict(), method_state=self._method_state())
        _log(f"checkpoint {path} ({time.time() - t0:.1f}s)")

    def _finish(self) -> None:
        if dist.get_rank() == 0:
            self.rewards.close()
            if self.cfg.logging.plot:
                from megarl.trainer.plot import plot_run

                png = plot_run(self.run_dir)
                if png is not None:
                    _log(f"reward curve: {png}")
            recs = read_metrics(self.run_dir)
            first = next((r for r in recs if "eval/pass@1" in r), None)
            last = next((r for r in reversed(recs) if "eval/pass@1" in r), None)
            if first is not None and last is not None and first is not last:
                for k in [k for k in first if k.startswith("eval/") and isinstance(first[k], float)
                          and k != "eval/reward_greedy" and k in last]:
                    _log(f"held-out {k[5:]}: {first[k]:.3f} (step {first['step']}) -> {last[k]:.3f} "
                         f"(step {last['step']})")
            _log(f"metrics: {self.run_dir / 'metrics.jsonl'}")
            self.metrics.close()
        if self.engine is not None:
            self.loop.run_until_complete(self.engine.close())
        self.loop.close()


def _eval_text(rec: dict) -> str:
    parts = [f"{k[5:]} {v:.3f}" for k, v in rec.items()
             if k.startswith("eval/") and k != "eval/reward_greedy" and isinstance(v, float)]
    return ("  | held-out " + "  ".join(parts)) if parts else ""


class _HFTokenizer:
    """A transformers tokenizer behind the CharTokenizer interface (encode/decode/eos_id)."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_id = tok.eos_token_id
        self.pad_id = tok.pad_token_id

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=bos)

    def decode(self, ids: list[int]) -> str:
        if self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        return self.tok.decode(ids, skip_special_tokens=True)
