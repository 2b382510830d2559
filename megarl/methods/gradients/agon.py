"""Agon: two trainable policies that grade each other (reconstructed).

Two models, A (the run's policy) and B (a second trainable policy of the same architecture that
this method builds, with its own optimizer and checkpoint), swap roles every RL step: on odd
steps A drafts and B reads, on even steps B drafts and A reads. Per prompt x the drafter samples
G drafts ``d_j ~ π_D(·|x)``; the reader answers once per draft, reading it in its context
(``a_j ~ π_S(·|x, d_j)``, the prompt rendered through ``method.reader_template``). With the
verifier's correctness c(·):

    r_D = c(d) + γ (c(d) − c(a)),      r_S = c(a) + γ (c(a) − c(d))

so the competitive parts sum to zero. Each model gets the run's advantage estimator (GRPO) over
its own G outputs for the prompt, and is updated by its own optimizer with the run's objective:
A by the trainer's optimizer steps, B by this method's step hook after them (the same
``ppo_epochs`` x ``mini_batches`` steps on its data-parallel share). γ = 0 gives two independent
GRPO learners (the reader conditioned on a draft).

One engine serves both models in turns (time-multiplexed): the drafter's weights are pushed, the
drafts generated, then the reader's (``RunContext.push_weights(label, learner)``), so reader
rollouts wait for the drafts of the same step. The run's evaluation measures A alone.

Provenance: reconstructed from the Agon abstract (two models alternate drafting and reading,
each rewarded for out-solving the other, both optimised); the reward formula, γ and the per-step
role swap are this reconstruction's choices.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.batch import PackedBatch, from_sequences
from megarl.methods.gradients.three_po import check_sync_loop
from megarl.objectives.api import GlobalNormalisers
from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.objectives.rl_objective import build_objective
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodParts, MethodSpec

VERDICTS = ("correct", "reward")


@dataclass
class AgonKnobs(Knobs):
    """gamma: γ, the weight of the zero-sum competitive part; reader_template: the reader's prompt
    (``{draft}`` and ``{prompt}`` are filled in); max_draft_chars: drafts are cut to this many
    characters before the reader sees them; second_init: B's initial weights (``policy``: the
    run's initial policy, or an HF checkpoint directory of the same architecture); verdict: c(·),
    ``correct`` (the reward check marked ``correct``; the weighted reward when none is) or
    ``reward`` (the run's weighted scalar reward, e.g. correctness plus a format reward)."""

    gamma: float = 1.0
    reader_template: str = "{draft} {prompt}"
    max_draft_chars: int = 16
    second_init: str = "policy"
    verdict: str = "correct"

    def check(self) -> None:
        """Ranges, placeholders and the checkpoint directory."""
        if self.gamma < 0:
            raise ValueError(f"method.gamma={self.gamma} must be >= 0")
        for key in ("{draft}", "{prompt}"):
            if key not in self.reader_template:
                raise ValueError(f"method.reader_template={self.reader_template!r} must contain {key}")
        if self.verdict not in VERDICTS:
            raise ValueError(f"method.verdict={self.verdict!r}; allowed: {', '.join(VERDICTS)}")
        if self.max_draft_chars < 1:
            raise ValueError(f"method.max_draft_chars={self.max_draft_chars} must be >= 1")
        if self.second_init != "policy" and not os.path.isfile(os.path.join(self.second_init, "config.json")):
            raise ValueError(
                f"method.second_init={self.second_init!r}: not 'policy' or an HF checkpoint directory "
                "(no config.json there)"
            )


def agon_rewards(
    c_draft: torch.Tensor, c_read: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_D, r_S) [G] of drafts with correctness ``c_draft`` and reader answers ``c_read``."""
    c_d, c_a = c_draft.double(), c_read.double()
    return c_d + gamma * (c_d - c_a), c_a + gamma * (c_a - c_d)


def drafter(step: int) -> str:
    """Which model drafts at RL ``step``: A on odd steps, B on even ones (balanced over steps)."""
    return "a" if step % 2 == 1 else "b"


def reader_text(template: str, draft: str, prompt: str, max_chars: int) -> str:
    """The reader's prompt: the template with the draft (cut to ``max_chars``) and the prompt."""
    return template.replace("{draft}", draft[:max_chars]).replace("{prompt}", prompt)


def step_prompts(num_rows: int, seed: int, step: int, count: int) -> list[int]:
    """The dataset rows of ``step`` (seeded by (seed, step), so a resumed run draws the same)."""
    rng = random.Random(seed * 1_000_003 + step)
    return [rng.randrange(num_rows) for _ in range(count)]


@dataclass
class Sequences:
    """One model's outputs of a step (plain lists, broadcast from rank 0)."""

    prompts: list[list[int]]
    responses: list[list[int]]
    logprobs: list[list[float]]
    group_ids: list[int]
    task_ids: list[int]
    truncated: list[bool]
    rewards: list[float]
    correct: list[float]

    def batch(self, step: int) -> PackedBatch:
        """The packed batch (rollout log-probs 0 on prompts and clamped <= 0, as the trainer's)."""
        lp: list[float] = []
        for p, r in zip(self.prompts, self.logprobs):
            lp += [0.0] * len(p) + [min(x, 0.0) for x in r]
        return from_sequences(
            self.prompts,
            self.responses,
            self.group_ids,
            rewards=torch.tensor(self.rewards, dtype=torch.float32),
            task_ids=torch.tensor(self.task_ids, dtype=torch.long),
            policy_versions=torch.full((len(self.prompts),), step - 1, dtype=torch.long),
            truncated=torch.tensor(self.truncated, dtype=torch.bool),
            rollout_logprobs=torch.tensor(lp, dtype=torch.float32),
        )


def group_bounds(num_groups: int, parts: int, dp: int) -> list[int]:
    """Group boundaries of ``parts`` mini-batches with at least ``dp`` groups each ([] if too few)."""
    if num_groups < dp:
        return []
    n = min(parts, num_groups // dp)
    return torch.linspace(0, num_groups, n + 1).round().long().tolist()


class Agon:
    """The method's batch source and step hook (every rank); see the module docstring."""

    def __init__(self, ctx: Any, knobs: AgonKnobs):
        cfg = ctx.cfg
        self.ctx, self.knobs, self.cfg = ctx, knobs, cfg
        init = ctx.init_dir if knobs.second_init == "policy" else knobs.second_init
        self.second = ctx.make_learner(ctx.hf_config, init, trainable=True)
        o = cfg.objective
        self.needs_entropy = "entropies" in POLICY_LOSSES.info(o.policy_loss).batch_inputs
        self.reference = ctx.make_learner(ctx.hf_config, init, trainable=False) if o.kl_coef else None
        self.objective = build_objective(o)
        est = cfg.advantage.estimator
        self.estimator = ADVANTAGE_ESTIMATORS.get(est)
        self.estimator_knobs = dict(cfg.advantage.knobs)
        self._second_batch: PackedBatch | None = None
        self._metrics: dict[str, float] = {}

    def learner(self, role: str) -> Any:
        """A's learner (the run's policy) or B's."""
        return self.ctx.policy if role == "a" else self.second

    # ---------------------------------------------------------------- two-stage generation
    def _generate(self, prompts: list[list[int]], n: int, step: int, rnd: int) -> list:
        """Rank 0: ``n`` samples per prompt from the engine's current weights."""
        ctx = self.ctx
        params = [ctx.sampling(step, rnd, i) for i in range(len(prompts))]

        async def all_of() -> list:
            return await asyncio.gather(
                *[ctx.engine.generate(p, n=n, sampling=sp) for p, sp in zip(prompts, params)]
            )

        return ctx.run_coroutine(all_of())

    def _correct(self, texts: list[str], answers: list[str]) -> list[float]:
        """c(·) of ``texts`` (``method.verdict``)."""
        res = self.ctx.score(texts, answers)
        c = res.correct if res.correct is not None and self.knobs.verdict == "correct" else res.scalar
        return [float(x) for x in c.double()]

    def _rollouts(self, step: int) -> tuple[Sequences, Sequences]:
        """(the drafter's, the reader's) outputs of ``step``; collective (two weight pushes)."""
        ctx, k, cfg = self.ctx, self.knobs, self.cfg
        d_role = drafter(step)
        r_role = "b" if d_role == "a" else "a"
        G = cfg.rollout.n
        rows, tok, drafts, prompts = [], ctx.tokenizer, [], []
        if ctx.rank0:
            ds = ctx.dataset
            count = cfg.schedule.prompts_per_step
            rows = [ds.rows[i] for i in step_prompts(len(ds.rows), cfg.schedule.seed, step, count)]
            prompts = [tok.encode(r.prompt) for r in rows]
        ctx.push_weights(f"agon-{d_role}", self.learner(d_role))
        if ctx.rank0:
            drafts = [s for o in self._generate(prompts, G, step, 0) for s in o.samples]
        ctx.push_weights(f"agon-{r_role}", self.learner(r_role))
        if not ctx.rank0:
            return None, None  # type: ignore[return-value]
        d_texts = [tok.decode(s.token_ids) for s in drafts]
        owners = [i // G for i in range(len(drafts))]
        r_prompts = [
            tok.encode(reader_text(k.reader_template, t, rows[i].prompt, k.max_draft_chars))
            for t, i in zip(d_texts, owners)
        ]
        reads = [o.samples[0] for o in self._generate(r_prompts, 1, step, 1)]
        answers = [rows[i].answer for i in owners]
        c_d = self._correct(d_texts, answers)
        c_a = self._correct([tok.decode(s.token_ids) for s in reads], answers)
        r_d, r_s = agon_rewards(torch.tensor(c_d), torch.tensor(c_a), k.gamma)
        task = [ctx.dataset.task_id[rows[i].task] for i in owners]

        def seqs(ps, samples, rewards, correct) -> Sequences:
            return Sequences(
                ps,
                [list(s.token_ids) for s in samples],
                [list(s.logprobs) for s in samples],
                owners,
                task,
                [s.finish_reason == "length" for s in samples],
                rewards.tolist(),
                correct,
            )

        return seqs([prompts[i] for i in owners], drafts, r_d, c_d), seqs(r_prompts, reads, r_s, c_a)

    # ---------------------------------------------------------------- batch source
    def next_batch(self, step: int) -> PackedBatch:
        """A's batch of ``step`` (every rank); B's is kept for ``after_step``."""
        box = list(self._rollouts(step))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        draft, read = box
        a, b = (draft, read) if drafter(step) == "a" else (read, draft)
        self._second_batch = b.batch(step)
        mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
        self._metrics = {
            "agon/a_drafts": float(drafter(step) == "a"),
            "agon/draft_correct": mean(draft.correct),
            "agon/read_correct": mean(read.correct),
            "agon/a_correct": mean(a.correct),
            "agon/b_correct": mean(b.correct),
            "agon/zero_sum_residual": abs(
                sum(r - c for r, c in zip(draft.rewards, draft.correct))
                + sum(r - c for r, c in zip(read.rewards, read.correct))
            ),
        }
        return a.batch(step)

    # ---------------------------------------------------------------- step hook
    def before_train(self, step: int, batch: PackedBatch) -> PackedBatch:
        """A's batch as it is."""
        return batch

    def _inputs(self, batch: PackedBatch, micro: int) -> float:
        """B's own learner inputs: its log-probs (the old ones with ``schedule.old_logprobs:
        recompute``; entropies when the loss reads them), its reference's log-probs. Returns the
        mean |B's log-prob − the engine's| over B's response tokens: near 0 when the engine sampled
        B's outputs with B's weights."""
        lp, ent = self.second.compute_logprobs(batch, micro, with_entropy=self.needs_entropy)
        if self.cfg.schedule.old_logprobs == "recompute":
            batch.old_logprobs = lp
        if self.needs_entropy:
            batch.entropies = ent
        if self.reference is not None:
            batch.ref_logprobs = self.reference.compute_logprobs(batch, micro)[0]
        m = batch.loss_mask.bool()
        if not bool(m.any()):
            return 0.0
        return float((lp[m].double() - batch.rollout_logprobs[m].double()).abs().mean())

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        """B's optimizer steps on its own outputs (collective); the step's Agon metrics."""
        batch, self._second_batch = self._second_batch, None
        out = dict(self._metrics)
        if batch is None:
            return out
        s = self.cfg.schedule
        out["agon/b_logprob_gap"] = self._inputs(batch, s.micro_batches)
        batch.advantages = self.estimator(batch, **self.estimator_knobs).to(torch.float32)
        gids = torch.unique(batch.group_ids).tolist()
        dp = self.ctx.groups.dp_size if self.ctx.groups is not None else 1
        trained: list[dict] = []
        for _ in range(s.ppo_epochs):
            bounds = group_bounds(len(gids), s.mini_batches, dp)
            for lo, hi in itertools.pairwise(bounds):
                keep = set(gids[lo:hi])
                mb = batch.select([i for i, g in enumerate(batch.group_ids.tolist()) if g in keep])
                local = self.ctx.dp_share(mb)
                max_len = self.cfg.rollout.max_new_tokens
                norms = GlobalNormalisers.from_batch(local, self.ctx.dp_group, max_len)
                micro = max(1, min(s.micro_batches, local.num_seqs))
                trained.append(self.second.train_step(local, self.objective, micro, norms))
        for key in ("loss", "grad_norm"):
            if trained and key in trained[-1]:
                out[f"agon/b_{key}"] = sum(t[key] for t in trained) / len(trained)
        out["agon/b_optimizer_steps"] = float(len(trained))
        return out

    def state_dict(self) -> dict:
        """Nothing beside B's sharded state: roles and prompts are functions of the step."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore beside ``load_sharded``."""

    def save_sharded(self, directory: Path) -> None:
        """B's model, optimizer and scheduler (collective)."""
        from megarl.learner.dist_checkpoint import save_checkpoint

        save_checkpoint(self.second, directory)

    def load_sharded(self, directory: Path) -> None:
        """Restore ``save_sharded`` (collective)."""
        from megarl.learner.dist_checkpoint import load_checkpoint

        load_checkpoint(self.second, directory)


SUPPORTED_INPUTS = frozenset({"old_logprobs", "entropies", "ref_logprobs"})


def build(ctx, knobs: AgonKnobs) -> MethodParts:
    """The Agon part, the run's batch source and a step hook (every rank)."""
    check_sync_loop(ctx.cfg, "agon")
    if ctx.push_weights is None or (ctx.dataset is None and ctx.rank0):
        raise ValueError("method agon needs a run that pushes weights to its engine and has training prompts")
    est = ctx.cfg.advantage.estimator
    if ADVANTAGE_ESTIMATORS.info(est).make_state is not None:
        raise ValueError(f"method agon: advantage.estimator={est} keeps state; use a stateless one (grpo)")
    o = ctx.cfg.objective
    extra = set(POLICY_LOSSES.info(o.policy_loss).batch_inputs) - SUPPORTED_INPUTS
    if extra or o.regularisers or o.distill != "none":
        raise ValueError(
            "method agon: the second model gets old log-probs, entropies and reference log-probs only; "
            f"objective.policy_loss={o.policy_loss} / regularisers / distill need more ({sorted(extra)})"
        )
    part = Agon(ctx, knobs)
    return MethodParts(step_hooks=[part], batch_source=part)


SPEC = MethodSpec(
    name="agon",
    summary="two trainable policies swap drafter/reader roles and are rewarded for out-solving each other",
    provenance="reconstructed",
    config={"advantage": {"estimator": "grpo"}},
    knobs=AgonKnobs,
    build=build,
)
