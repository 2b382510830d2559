"""What one step's rollouts are on rank 0, from the collector's groups to the packed batch.

- ``SampleRecord`` / ``GroupRecord``: a prompt's finished samples with their rewards (shaped, the
  values the advantages see), reward dimensions, per-sample extras and policy versions;
- ``CollectedBatch``: the groups of one step plus rollout statistics (and their JSON form, which
  the asynchronous loop keeps in checkpoints);
- ``Rollouts``: the same flattened to per-sample lists (picklable for the broadcast to all ranks);
- ``build_batch``: the ``PackedBatch`` of a ``Rollouts``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from megarl.batch import PackedBatch, from_sequences
from megarl.data.dataset import PromptRow


@dataclass
class SampleRecord:
    """One finished sample: ``token_ids``/``logprobs`` [R]; ``text``: what was scored; ``loss_mask``
    [R], ``turn_spans`` and ``turn_rewards`` (one per answer) for samples of several answers;
    ``version``: the oldest policy version that
    generated any of its tokens; ``mixed``: generated across a weight update; ``extras``: the
    workflow's per-sample values (name -> float or row)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int
    mixed: bool = False
    truncated: bool = False
    text: str = ""
    loss_mask: list[float] | None = None
    turn_spans: list | None = None
    turn_rewards: list[float] | None = None
    extras: dict | None = None


@dataclass
class GroupRecord:
    """The ``n`` samples of one prompt with their rewards [n], reward dimensions and extras."""

    row: PromptRow
    uid: int
    prompt_ids: list[int]
    samples: list[SampleRecord]
    rewards: list[float] = field(default_factory=list)
    reward_dims: dict[str, list[float]] = field(default_factory=dict)
    extras: dict[str, list[float]] = field(default_factory=dict)
    rnd: int = 0
    index: int = 0

    @property
    def version(self) -> int:
        """The group's oldest sample version (what the staleness bound is checked on)."""
        return min(s.version for s in self.samples)


@dataclass
class CollectedBatch:
    """The groups of one step as the collector made them, plus its rollout statistics."""

    step: int
    groups: list[GroupRecord]
    stats: dict


def batch_to_json(b: CollectedBatch) -> dict:
    """A collected batch as plain JSON data (checkpoints)."""
    return {
        "step": b.step,
        "stats": b.stats,
        "groups": [
            {
                "row": [g.row.prompt, g.row.answer, g.row.task, g.row.source],
                "uid": g.uid,
                "prompt_ids": g.prompt_ids,
                "rewards": g.rewards,
                "reward_dims": g.reward_dims,
                "extras": g.extras,
                "rnd": g.rnd,
                "index": g.index,
                "samples": [asdict(s) for s in g.samples],
            }
            for g in b.groups
        ],
    }


def batch_from_json(d: dict) -> CollectedBatch:
    """The inverse of ``batch_to_json``."""
    groups = [
        GroupRecord(
            PromptRow(*g["row"]),
            g["uid"],
            g["prompt_ids"],
            [
                SampleRecord(
                    **{**s, "turn_spans": [tuple(x) for x in s["turn_spans"]] if s["turn_spans"] else None}
                )
                for s in g["samples"]
            ],
            g["rewards"],
            g["reward_dims"],
            g["extras"],
            g["rnd"],
            g["index"],
        )
        for g in d["groups"]
    ]
    return CollectedBatch(step=d["step"], groups=groups, stats=d["stats"])


@dataclass
class Rollouts:
    """The samples of one step, on rank 0 (plain lists, picklable for the broadcast).
    ``versions`` is empty when every sample comes from the step's own policy (the synchronous loop)."""

    prompt_ids: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    rollout_logprobs: list[list[float]] = field(default_factory=list)
    group_ids: list[int] = field(default_factory=list)
    task_ids: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    reward_dims: dict[str, list[float]] = field(default_factory=dict)
    responses: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    extras: dict[str, list[float]] = field(default_factory=dict)
    response_masks: list = field(default_factory=list)  # several answers: per sample [R] 1 on answer tokens
    turn_spans: list = field(default_factory=list)  # several answers: per sample [(start, end, role)]
    turn_rewards: list = field(default_factory=list)  # several answers: per sample [reward of each answer]
    versions: list[int] = field(default_factory=list)


def rollouts_from_groups(
    groups: list[GroupRecord], task_id: dict[str, int], reward_names: list[str], with_versions: bool
) -> Rollouts:
    """Flatten ``groups`` (group ids in order); per-sample ``versions`` only when ``with_versions``."""
    ro = Rollouts(reward_dims={k: [] for k in reward_names})
    multi_turn = any(s.turn_spans is not None for g in groups for s in g.samples)
    for gid, g in enumerate(groups):
        k = len(g.samples)
        ro.prompt_ids += [g.prompt_ids] * k
        ro.response_ids += [s.token_ids for s in g.samples]
        ro.rollout_logprobs += [s.logprobs for s in g.samples]
        ro.group_ids += [gid] * k
        ro.task_ids += [task_id[g.row.task]] * k
        ro.truncated += [s.truncated for s in g.samples]
        ro.rewards += g.rewards
        ro.responses += [s.text for s in g.samples]
        ro.answers += [g.row.answer] * k
        if multi_turn:
            ro.response_masks += [s.loss_mask for s in g.samples]
            ro.turn_spans += [s.turn_spans for s in g.samples]
            ro.turn_rewards += [s.turn_rewards or [] for s in g.samples]
        for name, v in g.extras.items():
            ro.extras.setdefault(name, []).extend(v)
        for name in ro.reward_dims:
            ro.reward_dims[name] += g.reward_dims[name]
        if with_versions:
            ro.versions += [s.version for s in g.samples]
    return ro


def apply_answer_masks(batch: PackedBatch, response_masks: list[list[float]], turn_spans: list[list]) -> None:
    """Samples of several answers in a batch built by ``from_sequences`` (whose loss mask covers every
    token after the prompt): the loss mask becomes 1 on answer tokens only (``response_masks[i]``:
    [R_i]) and ``batch.turn_spans`` their answer spans. In place."""
    if len(response_masks) != batch.num_seqs or len(turn_spans) != batch.num_seqs:
        raise ValueError(
            f"{batch.num_seqs} sequences but {len(response_masks)} response masks and "
            f"{len(turn_spans)} turn-span lists"
        )
    for i, m in enumerate(response_masks):
        start = int(batch.cu_seqlens[i]) + int(batch.prompt_lens[i])
        end = int(batch.cu_seqlens[i + 1])
        if len(m) != end - start:
            raise ValueError(
                f"sequence {i}: response mask has {len(m)} entries for {end - start} response tokens"
            )
        batch.loss_mask[start:end] = torch.tensor(m, dtype=batch.loss_mask.dtype)
    batch.turn_spans = [list(s) for s in turn_spans]
    batch.validate()


def build_batch(ro: Rollouts, step: int) -> PackedBatch:
    """The packed batch of ``ro``: rollout logprobs (0 on prompts, clamped <= 0), per-sample policy
    versions (``step - 1`` when ``ro.versions`` is empty), answer spans when present
    (``turn_spans``, and ``extras["turn_rewards"]`` [B, S] when the environment rewarded each answer)."""
    lp: list[float] = []
    for p, r_lp in zip(ro.prompt_ids, ro.rollout_logprobs):
        lp += [0.0] * len(p) + [min(x, 0.0) for x in r_lp]
    B = len(ro.group_ids)
    versions = (
        torch.tensor(ro.versions, dtype=torch.long)
        if ro.versions
        else torch.full((B,), step - 1, dtype=torch.long)
    )
    batch = from_sequences(
        ro.prompt_ids,
        ro.response_ids,
        ro.group_ids,
        rewards=torch.tensor(ro.rewards, dtype=torch.float32),
        task_ids=torch.tensor(ro.task_ids, dtype=torch.long),
        policy_versions=versions,
        truncated=torch.tensor(ro.truncated, dtype=torch.bool),
        rollout_logprobs=torch.tensor(lp, dtype=torch.float32),
    )
    if ro.turn_spans:  # several answers per sample: environment text out of the loss, spans kept
        apply_answer_masks(batch, ro.response_masks, ro.turn_spans)
    if any(ro.turn_rewards):  # the environment's reward after each of its steps: [B, S], 0-padded
        S = max(len(r) for r in ro.turn_rewards)
        tr = torch.zeros(B, S, dtype=torch.float64)
        for i, r in enumerate(ro.turn_rewards):
            tr[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        batch.extras["turn_rewards"] = tr
    return batch
