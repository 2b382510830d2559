"""SRRL (Self-Review Reinforcement Learning): when a first attempt fails, the model writes a
self-review that conditions a second attempt; the review is trained with policy gradients, the
successful second attempts are distilled into the plain policy, and a cross-episode memory keeps
successful reviews for similar prompts. Reconstructed: the abstract and related work only
(Reflect, Retry, Reward, arXiv 2505.24726); the formulas are ours (reference/agents.py srrl_*).

Episodes come from the ``review`` workflow (megarl/rollout/review.py): one sequence
``x, a_1 [, feedback + retrieved reviews, c, cue, a_2]`` per sample, with the rewards r_1, r_2 and
verdicts of both attempts in ``extras``. Parts:

- advantage estimator ``srrl`` (per token): a_1 tokens get GRPO over the group's first attempts
  (r_1); review tokens get the review reward d = r_2 − r_1, group-normalised over the group's
  reviewed samples; a_2 tokens get ``a2_coef`` x the review's advantage (the optional PG on a_2);
- step hook ``SelectiveDistillation``: for every fail→success episode (a_1 wrong, a_2 correct) it
  appends the sequence ``x, a_2`` (no review context) to the batch, in the episode's group, with
  zero advantage and ``extras['srrl_sd'] = 1``;
- policy loss ``srrl``: PPO-clip on the episodes, ``sd_coef`` x (−log π_θ(a_2 | x)) on the appended
  sequences, aggregated together (``objective.aggregation``);
- ``ReviewMemory``: (embedding of x, review) pairs of reviews whose second attempt succeeded,
  at most ``memory_size`` (oldest dropped first), the top ``memory_k`` by cosine similarity retrieved
  for a new x (ties: the older entry first); the embedding is a hashed character-trigram count
  vector (a stand-in for a task-embedding model). It is a round processor, so it is saved in
  checkpoints and restored on resume.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo
from megarl.batch import TOKEN_FIELDS, PackedBatch
from megarl.objectives.policy_losses import POLICY_LOSSES, ppo, seq_to_tokens
from megarl.plugin.knobs import Knobs
from megarl.plugin.rounds import RolloutRound, RoundResult
from megarl.plugin.spec import MethodParts, MethodSpec
from megarl.registry import PartInfo

R1, R2, C1, C2, REVIEWED = "review_r1", "review_r2", "review_c1", "review_c2", "reviewed"
SD = "srrl_sd"
FIRST, REVIEW, SECOND = 1, 2, 3


# ----------------------------------------------------------------------------------- memory
def embed(text: str, dim: int = 64) -> torch.Tensor:
    """A unit vector [dim] of hashed character-trigram counts of ``text`` (zeros for an empty text)."""
    v = torch.zeros(dim, dtype=torch.float64)
    padded = f"  {text} "
    for i in range(len(padded) - 2):
        v[zlib.crc32(padded[i : i + 3].encode()) % dim] += 1.0
    n = v.norm()
    return v / n if n > 0 else v


def top_k(query: torch.Tensor, keys: torch.Tensor, k: int) -> list[int]:
    """Indices of the ``k`` rows of ``keys`` [N, D] most cosine-similar to ``query`` [D]; ties go
    to the lower index. Deterministic given the embeddings."""
    if keys.shape[0] == 0 or k <= 0:
        return []
    sims = (keys @ query).tolist()
    return sorted(range(len(sims)), key=lambda i: (-sims[i], i))[:k]


class ReviewMemory:
    """The cross-episode memory of the module docstring (rank 0; a round processor)."""

    def __init__(self, capacity: int, k: int, dim: int = 64):
        self.capacity, self.k, self.dim = capacity, k, dim
        self.entries: list[tuple[str, str]] = []
        self.keys = torch.zeros(0, dim, dtype=torch.float64)
        self.added = 0

    def add(self, prompt: str, review: str) -> None:
        """Store a successful review; the oldest entries go beyond ``capacity``."""
        if self.capacity <= 0 or not review:
            return
        self.entries.append((prompt, review))
        self.keys = torch.cat([self.keys, embed(prompt, self.dim)[None]])[-self.capacity :]
        self.entries = self.entries[-self.capacity :]
        self.added += 1

    def retrieve(self, prompt: str) -> list[str]:
        """The reviews of the ``k`` most similar stored prompts, most similar first."""
        return [self.entries[i][1] for i in top_k(embed(prompt, self.dim), self.keys, self.k)]

    async def process(self, r: RolloutRound) -> RoundResult:
        """Metrics only (the workflow adds and retrieves)."""
        return RoundResult(
            metrics={"srrl/memory_size": float(len(self.entries)), "srrl/memory_added": float(self.added)}
        )

    def state_dict(self) -> dict:
        """The stored (prompt, review) pairs, oldest first."""
        return {"entries": [list(e) for e in self.entries], "added": self.added}

    def load_state_dict(self, state: dict) -> None:
        """Restore the pairs (their embeddings are recomputed)."""
        self.entries, self.keys, self.added = [], torch.zeros(0, self.dim, dtype=torch.float64), 0
        for p, rv in state.get("entries", []):
            self.add(p, rv)
        self.added = int(state.get("added", self.added))


# ------------------------------------------------------------------------------- advantages
def token_roles(batch: PackedBatch) -> torch.Tensor:
    """[T] long: FIRST on a_1's tokens (the first ``assistant`` span), REVIEW on ``review`` spans,
    SECOND on later ``assistant`` spans, 0 elsewhere."""
    roles = torch.zeros(batch.num_tokens, dtype=torch.long)
    if batch.turn_spans is None:
        roles[batch.loss_mask > 0] = FIRST
        return roles
    for i, spans in enumerate(batch.turn_spans):
        base, seen = int(batch.cu_seqlens[i]), False
        for s, e, role in spans:
            if role == "assistant":
                roles[base + s : base + e] = SECOND if seen else FIRST
                seen = True
            elif role == "review":
                roles[base + s : base + e] = REVIEW
    return roles


def _extra(batch: PackedBatch, key: str) -> torch.Tensor:
    if key not in batch.extras:
        raise ValueError(f"srrl needs extras['{key}'] (environment.name: review writes it)")
    return batch.extras[key].double()


def review_advantages(batch: PackedBatch, scale_by_std: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence [B]: (GRPO of r_1 over the group, the review advantage: d = r_2 − r_1 GRPO-
    normalised over the group's reviewed samples, 0 on the others)."""
    r1, r2, rev = _extra(batch, R1), _extra(batch, R2), _extra(batch, REVIEWED) > 0.5
    a1 = grpo(r1, batch.group_ids, scale_by_std)
    ac = torch.zeros_like(a1)
    if bool(rev.any()):
        ac[rev] = grpo((r2 - r1)[rev], batch.group_ids[rev], scale_by_std)
    return a1, ac


@ADVANTAGE_ESTIMATORS.register("srrl", group_relative=True)
def srrl_advantages(batch: PackedBatch, scale_by_std: bool = True, a2_coef: float = 0.0) -> torch.Tensor:
    """Per token [T]: a_1 tokens the first attempts' GRPO advantage, review tokens the review
    advantage, a_2 tokens ``a2_coef`` x the review advantage; 0 off the loss mask."""
    a1, ac = review_advantages(batch, scale_by_std)
    roles, seq = token_roles(batch), batch.seq_index()
    out = torch.zeros(batch.num_tokens, dtype=torch.float64)
    out = torch.where(roles == FIRST, a1[seq], out)
    out = torch.where(roles == REVIEW, ac[seq], out)
    out = torch.where(roles == SECOND, a2_coef * ac[seq], out)
    return out * batch.loss_mask.double()


# ---------------------------------------------------------------------- selective distillation
def distill_set(batch: PackedBatch) -> list[int]:
    """The fail→success episodes: reviewed, a_1 wrong, a_2 correct."""
    rev, c1, c2 = _extra(batch, REVIEWED) > 0.5, _extra(batch, C1) > 0.5, _extra(batch, C2) > 0.5
    return (rev & ~c1 & c2).nonzero()[:, 0].tolist()


def gather_sequences(
    batch: PackedBatch, src: list[int], tok_idx: list[torch.Tensor], prompt_lens: list[int]
) -> PackedBatch:
    """New sequences made of the given absolute token positions of ``batch`` (sequence ``src[j]``'s
    per-sequence values and extras; turn spans ``prompt`` + ``assistant``)."""
    ids = torch.as_tensor(src, dtype=torch.long)
    lens = torch.tensor([len(t) for t in tok_idx], dtype=torch.long)
    idx = torch.cat(tok_idx) if tok_idx else torch.zeros(0, dtype=torch.long)
    cu = torch.zeros(len(src) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lens, 0)
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if f.name == "cu_seqlens":
            kw[f.name] = cu
        elif f.name == "prompt_lens":
            kw[f.name] = torch.tensor(prompt_lens, dtype=torch.long)
        elif f.name in ("tokens", "loss_mask", "routed_experts") or f.name in TOKEN_FIELDS:
            kw[f.name] = None if v is None else v[idx.to(v.device)]
        elif f.name == "turn_spans":
            kw[f.name] = [
                [(0, p, "prompt"), (p, int(n), "assistant")] for p, n in zip(prompt_lens, lens.tolist())
            ]
        elif f.name == "extras":
            kw[f.name] = {k: t[ids] for k, t in v.items()}
        elif f.name == "token_extras":
            kw[f.name] = {k: t[idx.to(t.device)] for k, t in v.items()}
        elif isinstance(v, torch.Tensor):
            kw[f.name] = v[ids]
        else:
            kw[f.name] = v
    return PackedBatch(**kw)


def concat(a: PackedBatch, b: PackedBatch) -> PackedBatch:
    """``a``'s sequences then ``b``'s (same fields present in both)."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "cu_seqlens":
            kw[f.name] = torch.cat([x, y[1:] + x[-1]])
        elif f.name == "turn_spans":
            kw[f.name] = None if x is None else list(x) + list(y or [])
        elif f.name in ("extras", "token_extras"):
            kw[f.name] = {k: torch.cat([x[k], y[k].to(x[k].device)]) for k in x}
        elif isinstance(x, torch.Tensor):
            kw[f.name] = torch.cat([x, y.to(x.device)])
        else:
            kw[f.name] = x
    return PackedBatch(**kw)


def with_distillation(batch: PackedBatch) -> tuple[PackedBatch, int]:
    """``batch`` with ``x, a_2`` of every fail→success episode appended (zero advantage,
    ``extras['srrl_sd']`` 1 on them, 0 on the episodes); how many were appended."""
    batch.extras[SD] = torch.zeros(batch.num_seqs, dtype=torch.float64)
    src = distill_set(batch)
    if not src:
        return batch, 0
    roles = token_roles(batch)
    toks, plens = [], []
    for i in src:
        a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
        p = int(batch.prompt_lens[i])
        a2 = (roles[a:b] == SECOND).nonzero()[:, 0] + a
        toks.append(torch.cat([torch.arange(a, a + p), a2]))
        plens.append(p)
    extra = gather_sequences(batch, src, toks, plens)
    extra.extras[SD] = torch.ones(len(src), dtype=torch.float64)
    if extra.advantages is not None:
        extra.advantages = torch.zeros_like(extra.advantages)
    return concat(batch, extra).validate(), len(src)


class SelectiveDistillation:
    """The step hook of the module docstring (every rank, the same whole batch)."""

    def __init__(self):
        self.last = 0

    def before_train(self, step: int, batch: PackedBatch) -> PackedBatch:
        """The batch with the distillation sequences appended."""
        out, self.last = with_distillation(batch)
        return out

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        """How many sequences were distilled this step."""
        return {"srrl/distilled": float(self.last)}

    def state_dict(self) -> dict:
        """Nothing to save."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


# ------------------------------------------------------------------------------------ loss
def srrl_loss(
    logp,
    old_logp,
    adv,
    mask,
    cu_seqlens,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    *,
    sd_coef: float = 1.0,
    batch=None,
    ctx=None,
) -> torch.Tensor:
    """Per-token loss: PPO clip on the episodes, sd_coef x (−log π_θ) on the distillation sequences."""
    sd = batch.extras.get(SD)
    if sd is None:
        sd = torch.zeros(batch.num_seqs, dtype=logp.dtype)
    sd_tok = seq_to_tokens(sd, batch.seq_lens, logp)
    pg = ppo(logp, old_logp, adv, mask, cu_seqlens, clip_low, clip_high, dual_clip)
    return (1 - sd_tok) * pg - sd_coef * sd_tok * logp


def _token_metrics(logp, old_logp, adv, mask, cu_seqlens, *, batch, **_):
    """Per token: whether it is a distillation token."""
    sd = batch.extras.get(SD, torch.zeros(batch.num_seqs))
    return {"sd_frac": seq_to_tokens(sd, batch.seq_lens, logp)}


POLICY_LOSSES.add("srrl", srrl_loss, PartInfo(token_metrics=_token_metrics, needs_context=True))


@dataclass
class SRRLKnobs(Knobs):
    """memory_size: reviews kept (0: no memory); memory_k: reviews retrieved per prompt."""

    memory_size: int = 256
    memory_k: int = 1

    def check(self) -> None:
        """Ranges."""
        if self.memory_size < 0:
            raise ValueError(f"method.memory_size={self.memory_size} must be >= 0")
        if self.memory_k < 0:
            raise ValueError(f"method.memory_k={self.memory_k} must be >= 0")


def build(ctx: Any, knobs: SRRLKnobs) -> MethodParts:
    """The memory (round processor and the workflow's ``memory``) and the distillation hook."""
    cfg = ctx.cfg
    if cfg.environment.name != "review":
        raise ValueError(
            f"method srrl: environment.name={cfg.environment.name!r}; srrl needs environment.name: review"
        )
    if cfg.objective.kl_coef:
        raise ValueError(
            f"method srrl: objective.kl_coef={cfg.objective.kl_coef}; the appended distillation sequences "
            "carry no reference logprobs of their own context, so srrl runs without the KL term (set 0)"
        )
    parts = MethodParts(step_hooks=[SelectiveDistillation()])
    if knobs.memory_size > 0:
        memory = ReviewMemory(knobs.memory_size, knobs.memory_k)
        parts.round_processors.append(memory)
        parts.workflow_parts["memory"] = memory
    return parts


SPEC = MethodSpec(
    name="srrl",
    summary="SRRL: self-review after a failed attempt (PG on the review), fail→success distilled, memory",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "srrl"},
        "environment": {"name": "review"},
        "objective": {"policy_loss": "srrl", "kl_coef": 0.0, "policy_loss_args": {"sd_coef": 1.0}},
    },
    knobs=SRRLKnobs,
    build=build,
)
