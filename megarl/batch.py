"""The one batch schema from rollout to loss.

A batch holds B sequences (prompt + response tokens). megarl works on the *packed* layout
(THD: all tokens concatenated, ``cu_seqlens`` marks the boundaries); reference/ works on the
*padded* layout ``[B, L]`` with a mask. ``pack`` and ``unpack`` convert between them.

Alignment convention (used by every objective and by the learner): a per-token field at index
``t`` is about token ``tokens[t]``. ``*_logprobs[t] = log p(tokens[t] | tokens[<t] of the same
sequence)``. The first token of a sequence has no logprob, so its ``loss_mask`` is always 0.
Logits handed to objectives are aligned the same way: ``logits[t]`` is the distribution that
scored ``tokens[t]`` (the learner shifts the model's next-token logits by one within each
sequence before calling an objective).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.ops.segments import segment_sum, token_to_seq

# Per-token float fields that travel with the batch. ``loss_mask`` is always present.
TOKEN_FIELDS: tuple[str, ...] = (
    "rollout_logprobs",
    "old_logprobs",
    "ref_logprobs",
    "teacher_logprobs",
    "self_teacher_logprobs",
    "advantages",
    "returns",
    "values",
    "entropies",
    "token_rewards",
)


class BatchValidationError(ValueError):
    """A batch field is malformed; the message names the field and, where known, the sequence."""


@dataclass
class PackedBatch:
    """B sequences packed into T tokens (the learner's layout).

    Per sequence (length B): ``prompt_lens``, ``group_ids``, ``task_ids``, ``rewards`` ([B] or
    [B, K] for K named reward dimensions), ``policy_versions``, ``truncated``, ``turn_spans``.
    Per token (length T): ``tokens``, ``loss_mask`` and the optional ``TOKEN_FIELDS``.
    ``routed_experts`` ([T, n_moe_layers, topk], int) is optional MoE routing to replay.
    ``token_extras``: per-token tensors ``[T, ...]`` of the run's inputs that travel with their
    tokens through ``select``/``split`` (e.g. the teacher's logits ``[T, V/tp]`` on the last
    pipeline stage, its top-K ids and logprobs ``[T, K]``).
    """

    tokens: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [B+1] int64, cu_seqlens[0] == 0, cu_seqlens[-1] == T
    prompt_lens: torch.Tensor  # [B] int64
    loss_mask: torch.Tensor  # [T] float (1 on tokens the loss may touch)
    group_ids: torch.Tensor  # [B] int64, sequences with the same id answer the same prompt
    task_ids: torch.Tensor | None = None  # [B] int64
    rewards: torch.Tensor | None = None  # [B] or [B, K] float
    policy_versions: torch.Tensor | None = None  # [B] int64
    truncated: torch.Tensor | None = None  # [B] bool
    turn_spans: list[list[tuple[int, int, str]]] | None = None  # per seq: (start, end, role)
    rollout_logprobs: torch.Tensor | None = None  # [T]
    old_logprobs: torch.Tensor | None = None  # [T]
    ref_logprobs: torch.Tensor | None = None  # [T]
    teacher_logprobs: torch.Tensor | None = None  # [T]
    self_teacher_logprobs: torch.Tensor | None = None  # [T] the policy's own, with a privileged context
    advantages: torch.Tensor | None = None  # [T]
    returns: torch.Tensor | None = None  # [T]
    values: torch.Tensor | None = None  # [T]
    entropies: torch.Tensor | None = None  # [T]
    token_rewards: torch.Tensor | None = None  # [T] dense per-token rewards (GAE, process rewards)
    routed_experts: torch.Tensor | None = None  # [T, n_moe_layers, topk] int
    reward_names: list[str] | None = None  # names of the K reward dimensions
    extras: dict = field(default_factory=dict)  # method-specific per-seq tensors [B, ...]
    token_extras: dict = field(default_factory=dict)  # per-token tensors [T, ...] (see the docstring)

    # ----------------------------------------------------------------------------- shape info
    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def seq_lens(self) -> torch.Tensor:
        """[B] lengths of the sequences."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def seq_index(self) -> torch.Tensor:
        """[T] index of the sequence each token belongs to."""
        return token_to_seq(self.cu_seqlens)

    def response_lens(self) -> torch.Tensor:
        """[B] number of loss tokens per sequence."""
        return segment_sum(self.loss_mask.to(torch.float64), self.cu_seqlens).round().long()

    # ----------------------------------------------------------------------------- validation
    def validate(self) -> PackedBatch:
        """Check shapes, dtypes and consistency; raise ``BatchValidationError`` naming the field."""
        _validate_packed(self)
        return self

    # ----------------------------------------------------------------------------- slicing
    def select(self, seq_ids: torch.Tensor | list[int]) -> PackedBatch:
        """A new packed batch with only the sequences ``seq_ids`` (in that order)."""
        ids = torch.as_tensor(seq_ids, dtype=torch.long)
        lens = self.seq_lens[ids]
        starts = self.cu_seqlens[:-1][ids]
        tok_idx = (
            torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), lens.tolist())])
            if ids.numel()
            else torch.zeros(0, dtype=torch.long)
        )
        cu = torch.zeros(ids.numel() + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(lens, 0)
        kw = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "cu_seqlens":
                kw[f.name] = cu
            elif f.name in ("tokens", "loss_mask", "routed_experts") or f.name in TOKEN_FIELDS:
                kw[f.name] = None if v is None else v[tok_idx]
            elif f.name == "turn_spans":
                kw[f.name] = None if v is None else [v[i] for i in ids.tolist()]
            elif f.name == "extras":
                kw[f.name] = {k: t[ids] for k, t in v.items()}
            elif f.name == "token_extras":
                kw[f.name] = {k: t[tok_idx.to(t.device)] for k, t in v.items()}
            elif isinstance(v, torch.Tensor):
                kw[f.name] = v[ids]
            else:
                kw[f.name] = v
        return PackedBatch(**kw)

    def split(self, num_micro_batches: int) -> list[PackedBatch]:
        """Split into ``num_micro_batches`` contiguous runs of whole sequences (sizes differ by <= 1)."""
        if num_micro_batches < 1 or num_micro_batches > max(self.num_seqs, 1):
            raise BatchValidationError(
                f"num_micro_batches={num_micro_batches} must be in [1, num_seqs={self.num_seqs}]"
            )
        bounds = torch.linspace(0, self.num_seqs, num_micro_batches + 1).round().long().tolist()
        return [self.select(list(range(a, b))) for a, b in itertools.pairwise(bounds)]


@dataclass
class PaddedBatch:
    """The same B sequences padded to ``[B, L]`` (reference/'s layout); ``attention_mask`` marks real
    tokens."""

    tokens: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L] bool
    loss_mask: torch.Tensor  # [B, L] float (0 on padding)
    per_token: dict[str, torch.Tensor]  # name -> [B, L] (0 on padding)
    per_seq: dict[str, Any]  # the PackedBatch per-sequence fields, unchanged


# --------------------------------------------------------------------------------- conversions
def pack(padded: PaddedBatch) -> PackedBatch:
    """Padded ``[B, L]`` -> packed THD (drops padding). Inverse of ``unpack``."""
    am = padded.attention_mask.bool()
    lens = am.sum(1).long()
    cu = torch.zeros(lens.numel() + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lens, 0)
    kw = {name: t[am] for name, t in padded.per_token.items()}
    return PackedBatch(
        tokens=padded.tokens[am], cu_seqlens=cu, loss_mask=padded.loss_mask[am], **kw, **padded.per_seq
    )


def unpack(packed: PackedBatch, pad_to: int | None = None, pad_id: int = 0) -> PaddedBatch:
    """Packed THD -> padded ``[B, L]`` with L = max length (or ``pad_to``)."""
    lens = packed.seq_lens
    L = int(lens.max()) if lens.numel() else 0
    if pad_to is not None:
        if pad_to < L:
            raise BatchValidationError(f"pad_to={pad_to} is shorter than the longest sequence ({L})")
        L = pad_to
    B = packed.num_seqs
    am = torch.arange(L).unsqueeze(0) < lens.unsqueeze(1)  # [B, L]

    def scatter(x: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((B, L) + tuple(x.shape[1:]), fill, dtype=x.dtype)
        out[am] = x
        return out

    per_token = {}
    for name in TOKEN_FIELDS:
        v = getattr(packed, name)
        if v is not None:
            per_token[name] = scatter(v, 0)
    if packed.routed_experts is not None:
        per_token["routed_experts"] = scatter(packed.routed_experts, -1)
    per_seq = {
        f.name: getattr(packed, f.name)
        for f in dataclasses.fields(packed)
        if f.name not in ("tokens", "cu_seqlens", "loss_mask", "routed_experts") + TOKEN_FIELDS
    }
    return PaddedBatch(
        tokens=scatter(packed.tokens, pad_id),
        attention_mask=am,
        loss_mask=scatter(packed.loss_mask, 0),
        per_token=per_token,
        per_seq=per_seq,
    )


def from_sequences(
    prompts: list[list[int]], responses: list[list[int]], group_ids: list[int], **per_seq
) -> PackedBatch:
    """Build a packed batch from token-id lists; the loss mask covers the response tokens."""
    if len(prompts) != len(responses) or len(prompts) != len(group_ids):
        raise BatchValidationError(
            f"prompts ({len(prompts)}), responses ({len(responses)}) and group_ids ({len(group_ids)}) "
            "must have the same length"
        )
    toks, mask, lens = [], [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) == 0:
            raise BatchValidationError(f"prompts[{i}]: a prompt needs at least one token")
        toks += list(p) + list(r)
        mask += [0.0] * len(p) + [1.0] * len(r)
        lens.append(len(p) + len(r))
    cu = torch.zeros(len(lens) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.long), 0)
    conv: dict[str, Any] = {
        k: (torch.as_tensor(v) if not isinstance(v, (torch.Tensor, type(None))) and k != "turn_spans" else v)
        for k, v in per_seq.items()
    }
    return PackedBatch(
        tokens=torch.tensor(toks, dtype=torch.long),
        cu_seqlens=cu,
        prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.long),
        loss_mask=torch.tensor(mask),
        group_ids=torch.as_tensor(group_ids, dtype=torch.long),
        **conv,
    ).validate()


# --------------------------------------------------------------------------------- validation
def _fail(field_name: str, msg: str, seq: int | None = None) -> None:
    where = f"field '{field_name}'" + (f", sequence {seq}" if seq is not None else "")
    raise BatchValidationError(f"{where}: {msg}")


def _validate_packed(b: PackedBatch) -> None:
    if b.tokens.dim() != 1:
        _fail("tokens", f"expected shape [T], got {tuple(b.tokens.shape)}")
    if b.tokens.dtype not in (torch.int32, torch.int64):
        _fail("tokens", f"expected an integer dtype, got {b.tokens.dtype}")
    T = b.tokens.numel()
    cu = b.cu_seqlens
    if cu.dim() != 1 or cu.numel() < 1:
        _fail("cu_seqlens", f"expected shape [B+1], got {tuple(cu.shape)}")
    if int(cu[0]) != 0:
        _fail("cu_seqlens", f"must start at 0, starts at {int(cu[0])}")
    if int(cu[-1]) != T:
        _fail("cu_seqlens", f"must end at the number of tokens T={T}, ends at {int(cu[-1])}")
    lens = cu[1:] - cu[:-1]
    bad = (lens <= 0).nonzero().flatten()
    if bad.numel():
        _fail("cu_seqlens", f"sequence length {int(lens[bad[0]])} is not positive", int(bad[0]))
    B = lens.numel()
    if B == 0:
        _fail("cu_seqlens", "the batch holds no sequence")
    for name in ("prompt_lens", "group_ids", "task_ids", "policy_versions", "truncated"):
        v = getattr(b, name)
        if v is not None and (v.dim() != 1 or v.numel() != B):
            _fail(name, f"expected shape [B={B}], got {tuple(v.shape)}")
    if b.prompt_lens is None:
        _fail("prompt_lens", "is required")
    if b.group_ids is None:
        _fail("group_ids", "is required")
    badp = ((b.prompt_lens < 1) | (b.prompt_lens > lens)).nonzero().flatten()
    if badp.numel():
        i = int(badp[0])
        _fail(
            "prompt_lens",
            f"prompt length {int(b.prompt_lens[i])} outside [1, sequence length {int(lens[i])}]",
            i,
        )
    if b.rewards is not None:
        if b.rewards.dim() not in (1, 2) or b.rewards.shape[0] != B:
            _fail("rewards", f"expected shape [B={B}] or [B={B}, K], got {tuple(b.rewards.shape)}")
        nonfinite = ~torch.isfinite(b.rewards.reshape(B, -1)).all(1)
        if nonfinite.any():
            i = int(nonfinite.nonzero()[0])
            _fail("rewards", f"reward {b.rewards[i].tolist()} is not finite", i)
        if b.reward_names is not None:
            k = 1 if b.rewards.dim() == 1 else b.rewards.shape[1]
            if len(b.reward_names) != k:
                _fail("reward_names", f"{len(b.reward_names)} names for {k} reward dimensions")
    for name, v in b.token_extras.items():
        if v.dim() < 1 or v.shape[0] != T:
            _fail(f"token_extras[{name!r}]", f"expected shape [T={T}, ...], got {tuple(v.shape)}")
    for name in ("loss_mask",) + TOKEN_FIELDS:
        v = getattr(b, name)
        if v is None:
            continue
        if v.dim() != 1 or v.numel() != T:
            _fail(name, f"expected shape [T={T}], got {tuple(v.shape)}")
        if not v.is_floating_point():
            _fail(name, f"expected a float dtype, got {v.dtype}")
    m = b.loss_mask
    if not ((m == 0) | (m == 1)).all():
        _fail("loss_mask", "values must be 0 or 1")
    first = cu[:-1]
    onfirst = (m[first] != 0).nonzero().flatten()
    if onfirst.numel():
        _fail(
            "loss_mask",
            "the first token of a sequence has no logprob and cannot be in the loss",
            int(onfirst[0]),
        )
    # Loss tokens must lie in the response (after the prompt).
    pos = torch.arange(T) - torch.repeat_interleave(first, lens)
    plen_tok = torch.repeat_interleave(b.prompt_lens, lens)
    inprompt = ((m != 0) & (pos < plen_tok)).nonzero().flatten()
    if inprompt.numel():
        t = int(inprompt[0])
        seq = int(torch.searchsorted(cu, torch.tensor(t), right=True)) - 1
        _fail(
            "loss_mask",
            f"token {int(pos[t])} is inside the prompt (prompt length {int(b.prompt_lens[seq])})",
            seq,
        )
    for name in ("rollout_logprobs", "old_logprobs", "ref_logprobs", "teacher_logprobs", "advantages"):
        v = getattr(b, name)
        if v is None:
            continue
        badv = ((m != 0) & ~torch.isfinite(v)).nonzero().flatten()
        if badv.numel():
            t = int(badv[0])
            seq = int(torch.searchsorted(cu, torch.tensor(t), right=True)) - 1
            _fail(name, f"non-finite value {float(v[t])} at token {int(pos[t])}", seq)
        if name.endswith("logprobs"):
            pos_lp = ((m != 0) & (v > 1e-6)).nonzero().flatten()
            if pos_lp.numel():
                t = int(pos_lp[0])
                seq = int(torch.searchsorted(cu, torch.tensor(t), right=True)) - 1
                _fail(name, f"logprob {float(v[t]):.4g} > 0 at token {int(pos[t])}", seq)
    if b.routed_experts is not None and (b.routed_experts.dim() != 3 or b.routed_experts.shape[0] != T):
        _fail("routed_experts", f"expected shape [T={T}, layers, topk], got {tuple(b.routed_experts.shape)}")
    if b.turn_spans is not None:
        if len(b.turn_spans) != B:
            _fail("turn_spans", f"expected {B} lists of spans, got {len(b.turn_spans)}")
        for i, spans in enumerate(b.turn_spans):
            for s, e, _role in spans:
                if not (0 <= s < e <= int(lens[i])):
                    _fail("turn_spans", f"span ({s}, {e}) outside [0, {int(lens[i])}]", i)
    for k, v in b.extras.items():
        if not isinstance(v, torch.Tensor) or v.shape[:1] != (B,):
            _fail(f"extras.{k}", f"expected a tensor with leading dimension B={B}")


def validate_groups(b: PackedBatch, min_group_size: int = 1) -> None:
    """Check that every group has at least ``min_group_size`` sequences and at least one loss token."""
    gids, counts = torch.unique(b.group_ids, return_counts=True)
    small = (counts < min_group_size).nonzero().flatten()
    if small.numel():
        g = int(gids[small[0]])
        seq = int((b.group_ids == g).nonzero()[0])
        _fail(
            "group_ids", f"group {g} has {int(counts[small[0]])} sequence(s), needs >= {min_group_size}", seq
        )
    ntok = segment_sum(b.loss_mask.double(), b.cu_seqlens)
    for g in gids.tolist():
        sel = b.group_ids == g
        if float(ntok[sel].sum()) == 0:
            _fail("loss_mask", f"group {g} has no loss token (empty group)", int(sel.nonzero()[0]))
