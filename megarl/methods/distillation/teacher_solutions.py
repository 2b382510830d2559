"""Teacher solutions: for the prompt groups a method selects, sample solutions from the teacher,
keep the ones the run's reward verifies, and append them to the step's batch flagged
``extras['teacher_solution'] = 1`` in the group of their prompt (a ``BatchExtender`` step hook).

Every rank finds the selected groups in the packed batch (the same whole batch everywhere); rank 0
samples ``samples`` solutions per group with the run's seeded sampling (round ``SOLUTION_ROUND``),
scores them with the run's reward functions and broadcasts the verified ones; every rank appends
them before the learner inputs, so the teacher, policy and reference passes see them like any
sample. Where the teacher's samples come from (``sampler_kind``):

- ``teacher.source: engine``: the teacher's own engines (vLLM / SGLang servers or the embedded
  engine on ``teacher.hf_dir``): any architecture sharing the policy's vocabulary;
- a Megatron teacher (``teacher.source: megatron``) of the policy's architecture: the run's rollout
  engine loads ``teacher.hf_dir`` from disk (no weights move between ranks) and serves the teacher
  until the step's weight sync gives it the policy again (the synchronous loop only);
- a Megatron teacher of another architecture in a run whose rollout engine is embedded: an
  embedded engine on ``teacher.hf_dir`` on rank 0 (a second copy of the teacher in rank 0's
  memory: small teachers);
- a Megatron teacher of another architecture with a server rollout engine: refused
  (``TeacherArchitectureError``; serve the teacher and set ``teacher.source: engine``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megarl.batch import PackedBatch, from_sequences
from megarl.plugin.inputs import RolloutInfo
from megarl.plugin.teacher_config import teacher_config

TEACHER_SOLUTION = "teacher_solution"  # extras [B]: 1.0 on teacher-written sequences
SOLUTION_ROUND = 1000  # the sampling round index of teacher solutions (seeds apart from rollouts)
NOT_ARCHITECTURE = frozenset(
    {
        "_name_or_path",
        "architectures",
        "bos_token_id",
        "dtype",
        "eos_token_id",
        "initializer_range",
        "pad_token_id",
        "torch_dtype",
        "transformers_version",
        "use_cache",
    }
)


class TeacherArchitectureError(ValueError):
    """The teacher cannot be sampled: a Megatron teacher whose architecture differs from the
    policy's, with a server rollout engine that can only load the policy's architecture."""


def architecture_difference(teacher_hf: dict, policy_hf: dict) -> str | None:
    """The first HF config key (architecture, not special-token ids or metadata) whose value
    differs between the two configs, as ``key: teacher vs policy``; None when they match."""
    for k in sorted((set(teacher_hf) | set(policy_hf)) - NOT_ARCHITECTURE):
        if teacher_hf.get(k) != policy_hf.get(k):
            return f"{k}: {teacher_hf.get(k)!r} vs {policy_hf.get(k)!r}"
    return None


def sampler_kind(cfg: Any, teacher_hf: dict | None, policy_hf: dict) -> str:
    """``teacher_engine``, ``run_engine`` or ``embedded`` (see the module docstring); raises
    ``TeacherArchitectureError`` for the refused case, ``ValueError`` without a teacher."""
    t = teacher_config(cfg)
    if t.source == "engine":
        return "teacher_engine"
    if not t.hf_dir or teacher_hf is None:
        raise ValueError("teacher solutions need a teacher: set teacher.hf_dir (or teacher.source: engine)")
    diff = architecture_difference(teacher_hf, policy_hf)
    if diff is None:
        return "run_engine"
    if cfg.rollout.engine == "embedded":
        return "embedded"
    raise TeacherArchitectureError(
        f"teacher.hf_dir={t.hf_dir}: the teacher's architecture differs from the policy's ({diff}); "
        f"rollout.engine={cfg.rollout.engine} serves the policy's architecture only, so it cannot "
        "sample the teacher's solutions. Serve the teacher (vLLM / SGLang) and set teacher.source: "
        "engine with teacher.urls, or use a teacher of the policy's architecture"
    )


def first_of_groups(batch: PackedBatch, selected: torch.Tensor) -> list[int]:
    """Index of the first sequence of every group with a ``selected`` [B] sequence, in batch order."""
    seen: set[int] = set()
    out = []
    for i, (g, s) in enumerate(zip(batch.group_ids.tolist(), selected.tolist())):
        if s and g not in seen:
            seen.add(g)
            out.append(i)
    return out


def verified(rewards: torch.Tensor, threshold: float) -> list[int]:
    """Indices of the sampled solutions whose reward exceeds ``threshold`` (kept)."""
    return [k for k, v in enumerate(rewards.tolist()) if v > threshold]


def group_accuracy(groups: list[int], keep: list[int]) -> dict[int, float]:
    """Group id -> the fraction of its samples (``groups[k]``: sample k's group) that are kept."""
    n: dict[int, int] = {}
    hit: dict[int, int] = {}
    kept = set(keep)
    for k, g in enumerate(groups):
        n[g] = n.get(g, 0) + 1
        hit[g] = hit.get(g, 0) + (k in kept)
    return {g: hit[g] / n[g] for g in n}


@dataclass
class Solutions:
    """Verified teacher samples (plain lists, broadcast from rank 0); ``source``: the batch index
    of the sequence whose prompt (and group, task, answer) each one answers."""

    source: list[int] = field(default_factory=list)
    responses: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    dims: dict[str, list[float]] = field(default_factory=dict)
    sampled: int = 0
    accuracy: dict[int, float] = field(default_factory=dict)  # group id -> verified fraction


def append_solutions(
    batch: PackedBatch, info: RolloutInfo, sol: Solutions, step: int
) -> tuple[PackedBatch, RolloutInfo]:
    """``batch`` and ``info`` with the solutions appended (prompt, group, task of their source
    sequence; rollout logprobs: the teacher's sampling logprobs; ``extras['teacher_solution']``
    1 on them and 0 elsewhere; other extras: 0 rows). Single-turn batches only."""
    B = batch.num_seqs
    flag = torch.zeros(B + len(sol.source), dtype=torch.float64)
    flag[B:] = 1.0
    if not sol.source:
        extras = {**info.extras, TEACHER_SOLUTION: flag.tolist()}
        return batch, RolloutInfo(list(info.answers), dict(info.reward_dims), extras)
    if batch.turn_spans is not None:
        raise ValueError("teacher solutions: the batch is multi-turn (turn_spans); single-turn batches only")
    if batch.rewards is not None and batch.rewards.dim() != 1:
        raise ValueError(
            f"teacher solutions: batch.rewards has shape {tuple(batch.rewards.shape)}, expected [B]"
        )
    cu, pl = batch.cu_seqlens.tolist(), batch.prompt_lens.tolist()
    prompts = [batch.tokens[cu[i] : cu[i] + pl[i]].tolist() for i in sol.source]
    src = torch.tensor(sol.source, dtype=torch.long)
    lp: list[float] = []
    for p, r in zip(prompts, sol.logprobs):
        lp += [0.0] * len(p) + [min(x, 0.0) for x in r]
    new = from_sequences(
        prompts,
        sol.responses,
        batch.group_ids[src].tolist(),
        rewards=torch.tensor(sol.rewards, dtype=torch.float32),
        task_ids=None if batch.task_ids is None else batch.task_ids[src],
        policy_versions=torch.full((len(src),), step - 1, dtype=torch.long),
        truncated=torch.tensor(sol.truncated, dtype=torch.bool),
        rollout_logprobs=torch.tensor(lp, dtype=torch.float32),
    )
    out = _concat(batch, new)
    extras = {k: _pad_rows(v, len(src)) for k, v in info.extras.items()}
    extras[TEACHER_SOLUTION] = flag.tolist()
    dims = {k: list(v) + list(sol.dims.get(k, [0.0] * len(src))) for k, v in info.reward_dims.items()}
    answers = list(info.answers) + [info.answers[i] for i in sol.source]
    return out, RolloutInfo(answers, dims, extras)


def _pad_rows(values: Any, n: int) -> list:
    """``values`` (per sample: a float or a row) followed by ``n`` zeros of the same shape."""
    vals = list(values)
    zero = torch.zeros_like(torch.as_tensor(vals[0], dtype=torch.float64)) if vals else torch.zeros(())
    fill = [zero.tolist() if zero.dim() else 0.0] * n
    return vals + fill


def _concat(a: PackedBatch, b: PackedBatch) -> PackedBatch:
    """``a``'s sequences then ``b``'s; fields ``b`` lacks are 0 rows (extras) or refused."""
    import dataclasses

    kw: dict[str, Any] = {}
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "cu_seqlens":
            kw[f.name] = torch.cat([x, y[1:] + x[-1]])
        elif f.name == "extras":
            kw[f.name] = {k: torch.cat([v, v.new_zeros((b.num_seqs, *v.shape[1:]))]) for k, v in x.items()}
        elif f.name == "token_extras":
            if x:
                raise ValueError(f"teacher solutions: the batch already has token extras {sorted(x)}")
            kw[f.name] = {}
        elif x is None:
            kw[f.name] = None
        elif isinstance(x, torch.Tensor):
            if y is None:
                raise ValueError(
                    f"teacher solutions: the batch field {f.name!r} is set before the learner inputs"
                )
            kw[f.name] = torch.cat([x, y.to(x.dtype)])
        else:
            kw[f.name] = x
    return PackedBatch(**kw).validate()


class TeacherSolutions:
    """The step hook (every rank). ``select(batch) -> [B] bool``: the sequences whose groups get
    teacher solutions; ``samples``: solutions sampled per selected group (0: none, only the
    ``rows_key`` flags); a solution is kept when its reward exceeds ``correct_threshold``;
    ``prefix``: the metrics' prefix; ``rows_key``: when set, ``extras[rows_key]`` is 1 on the
    selected sequences (0 on the rest and on the solutions): the rows the teacher's logprobs are
    needed on (``inputs.teacher_logprobs.rows``); ``acc_key``: when set, ``extras[acc_key]`` is the
    verified fraction of the teacher's samples of the sequence's group (0 where none were
    sampled); ``append``: False keeps the batch as it is (the samples only measure the teacher)."""

    def __init__(
        self,
        ctx: Any,
        select: Callable[[PackedBatch], torch.Tensor],
        samples: int,
        correct_threshold: float,
        prefix: str,
        teacher_hf: dict | None,
        rows_key: str = "",
        acc_key: str = "",
        append: bool = True,
    ):
        self.ctx, self.select, self.samples = ctx, select, samples
        self.threshold, self.prefix, self.rows_key = correct_threshold, prefix, rows_key
        self.acc_key, self.append = acc_key, append
        self.kind = sampler_kind(ctx.cfg, teacher_hf, ctx.hf_config) if samples > 0 else "none"
        self._engines: list | None = None
        self._metrics: dict[str, float] = {}

    # ---------------------------------------------------------------- rank 0
    def engines(self) -> list:
        """Rank 0's engines that sample the teacher (built on first use)."""
        if self.kind == "run_engine":
            return [self.ctx.engine]
        if self._engines is None:
            from megarl.plugin.engine_teacher import teacher_engines

            t = teacher_config(self.ctx.cfg)
            if self.kind == "teacher_engine":
                self._engines = teacher_engines(t)
            else:
                from megarl.rollout.embedded import EmbeddedEngine

                eos = [self.ctx.tokenizer.eos_id]
                self._engines = [
                    EmbeddedEngine.from_pretrained(str(t.hf_dir), name="teacher-sampler", eos_token_ids=eos)
                ]
        return self._engines

    def sample(self, step: int, batch: PackedBatch, info: RolloutInfo, firsts: list[int]) -> Solutions:
        """Rank 0: ``samples`` teacher solutions of each group of ``firsts``, scored; the verified ones."""
        ctx, cu, pl = self.ctx, batch.cu_seqlens.tolist(), batch.prompt_lens.tolist()
        engines = self.engines()
        if self.kind == "run_engine":  # the teacher's weights until the step's weight sync
            ctx.run_coroutine(engines[0].update_weights(str(teacher_config(ctx.cfg).hf_dir), "teacher"))
        prompts = [batch.tokens[cu[i] : cu[i] + pl[i]].tolist() for i in firsts]
        params = [ctx.sampling(step, SOLUTION_ROUND, j) for j in range(len(firsts))]

        async def all_of() -> list:
            return await asyncio.gather(
                *[
                    engines[j % len(engines)].generate(p, n=self.samples, sampling=sp)
                    for j, (p, sp) in enumerate(zip(prompts, params))
                ]
            )

        results = ctx.run_coroutine(all_of())
        source = [i for i, r in zip(firsts, results) for _ in r.samples]
        samples = [s for r in results for s in r.samples]
        texts = [ctx.tokenizer.decode(list(s.token_ids)) for s in samples]
        res = ctx.score(texts, [info.answers[i] for i in source])
        keep = verified(res.scalar, self.threshold)
        return Solutions(
            accuracy=group_accuracy([int(batch.group_ids[i]) for i in source], keep),
            source=[source[k] for k in keep],
            responses=[list(samples[k].token_ids) for k in keep],
            logprobs=[list(samples[k].logprobs) for k in keep],
            truncated=[samples[k].finish_reason == "length" for k in keep],
            rewards=[float(res.scalar[k]) for k in keep],
            dims={n: [float(v[k]) for k in keep] for n, v in res.dims.items()},
            sampled=len(samples),
        )

    # ---------------------------------------------------------------- every rank
    def extend_batch(
        self, step: int, batch: PackedBatch, info: RolloutInfo
    ) -> tuple[PackedBatch, RolloutInfo]:
        """The verified teacher solutions of the selected groups appended (collective)."""
        selected = self.select(batch)
        firsts = first_of_groups(batch, selected) if self.samples > 0 else []
        box: list = [Solutions()]
        if firsts and self.ctx.rank0:
            box[0] = self.sample(step, batch, info, firsts)
        if firsts and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        sol: Solutions = box[0]
        p = self.prefix
        self._metrics = {
            f"{p}/run_engine_swap": float(self.kind == "run_engine"),
            f"{p}/selected_groups": float(len(first_of_groups(batch, selected))),
            f"{p}/teacher_sampled": float(sol.sampled),
            f"{p}/teacher_verified": float(len(sol.source)),
        }
        if not self.append:
            sol = Solutions(sampled=sol.sampled, accuracy=sol.accuracy)
        out, out_info = append_solutions(batch, info, sol, step)
        if self.acc_key:
            acc = [sol.accuracy.get(g, 0.0) for g in batch.group_ids.tolist()]
            out_info.extras[self.acc_key] = acc + [0.0] * (out.num_seqs - batch.num_seqs)
            self._metrics[f"{p}/teacher_acc"] = sum(sol.accuracy.values()) / max(1, len(sol.accuracy))
        if self.rows_key:
            rows = torch.zeros(out.num_seqs, dtype=torch.float64)
            rows[: batch.num_seqs] = selected.double()
            out_info.extras[self.rows_key] = rows.tolist()
        return out, out_info

    def before_train(self, step: int, batch: PackedBatch) -> PackedBatch:
        """The batch as it is."""
        return batch

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        """The step's counts: selected groups, teacher samples, verified ones."""
        return dict(self._metrics)

    def state_dict(self) -> dict:
        """Nothing: the samples are functions of the step's batch and seed."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""

    def close(self) -> None:
        """Close the engines this hook built (rank 0)."""
        if self._engines:
            for e in self._engines:
                self.ctx.run_coroutine(e.close())
            self._engines = None
