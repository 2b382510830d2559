"""CRPO (Contrastive Reinforced Policy Optimization): multi-turn on-policy self-distillation read as
contrastive learning. The self-teacher (the policy with a privileged context: by default the
shortest correct rollout of the same group, ``inputs.self_teacher_context.source: sibling``) gives a
token gap ℓ_t; the student's entropy splits the tokens into positive positions (uncertain: the
teacher's guidance is trusted) and negative ones (confident, yet contradicted by the teacher: an
exposure bias of the privileged context); the gap is centred over the group at each aligned turn.
Formula and provenance: reference/agents.py ``crpo_advantages`` (reconstructed; no source found).

The ``crpo`` advantage estimator reads ``self_teacher_logprobs`` (stop-gradient),
``old_logprobs``, ``entropies`` (the behaviour policy's full-vocabulary entropy, vocab-parallel
under TP) and the batch's turn spans, and feeds the objective's PPO clip. It runs on the whole
batch before the data-parallel split, so every group is complete.
"""

from __future__ import annotations

import torch

from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS, grpo, per_token, scalar_rewards
from megarl.batch import PackedBatch
from megarl.methods.agents.privileged_gap import token_gap, turn_index
from megarl.methods.distillation.self_teacher import LOGPROBS, ON
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo


def crpo_positions(
    batch: PackedBatch, gap: torch.Tensor, entropy_threshold: float, gap_threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """([T] positive, [T] negative) bool positions among loss tokens of sequences with a context:
    P = {H_t ≥ entropy_threshold}, N = {H_t < entropy_threshold, |ℓ_t| ≥ gap_threshold}."""
    if batch.entropies is None:
        raise ValueError("advantage.estimator=crpo needs the batch field 'entropies'")
    on = batch.extras.get(ON, torch.ones(batch.num_seqs, dtype=torch.float64)).bool()
    live = batch.loss_mask.bool() & on.repeat_interleave(batch.seq_lens)
    h = batch.entropies.detach().double()
    pos = live & (h >= entropy_threshold)
    neg = live & (h < entropy_threshold) & (gap.abs() >= gap_threshold)
    return pos, neg


def group_turn_centre(batch: PackedBatch, gap: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """[T] ℓ̃_t = ℓ_t − mean of ℓ over the ``live`` tokens of the same group and turn index; 0 off
    ``live``. Σ ℓ̃ = 0 over each (group, turn)."""
    turn = turn_index(batch)
    grp = batch.group_ids.repeat_interleave(batch.seq_lens)
    idx = live.nonzero()[:, 0]
    out = torch.zeros_like(gap)
    if idx.numel() == 0:
        return out
    keys = torch.stack([grp[idx], turn[idx]], 1)
    uniq, inv = torch.unique(keys, dim=0, return_inverse=True)
    total = torch.zeros(len(uniq), dtype=gap.dtype).index_add_(0, inv, gap[idx])
    count = torch.zeros(len(uniq), dtype=gap.dtype).index_add_(0, inv, torch.ones_like(gap[idx]))
    out[idx] = gap[idx] - (total / count)[inv]
    return out


def _crpo(
    batch: PackedBatch,
    coef: float = 1.0,
    eta: float = 0.0,
    entropy_threshold: float = 0.5,
    gap_threshold: float = 1.0,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages plus coef x (the group-turn-centred gap on positive positions − eta x the
    same on negative positions)."""
    if coef < 0 or entropy_threshold < 0 or gap_threshold < 0:
        raise ValueError(
            f"advantage.coef={coef}, advantage.entropy_threshold={entropy_threshold} and "
            f"advantage.gap_threshold={gap_threshold} must be >= 0"
        )
    on = batch.extras.get(ON)
    gap = token_gap(batch, getattr(batch, LOGPROBS), on, f"the batch field '{LOGPROBS}'")
    pos, neg = crpo_positions(batch, gap, entropy_threshold, gap_threshold)
    has = torch.ones(batch.num_seqs, dtype=torch.bool) if on is None else on.bool()
    live = batch.loss_mask.bool() & has.repeat_interleave(batch.seq_lens)
    centred = group_turn_centre(batch, gap, live)
    shaped = coef * (pos.double() * centred - eta * neg.double() * centred)
    return per_token(batch, grpo(scalar_rewards(batch), batch.group_ids, scale_by_std, eps)) + shaped


ADVANTAGE_ESTIMATORS.add(
    "crpo",
    _crpo,
    PartInfo(batch_inputs=("old_logprobs", "entropies", LOGPROBS), group_relative=True),
)

SPEC = MethodSpec(
    name="crpo",
    summary="CRPO: GRPO plus the self-teacher's group-turn-centred token gap on high-entropy positions",
    provenance="reconstructed",
    config={
        "advantage": {"estimator": "crpo"},
        "inputs": {"self_teacher_context": {"source": "sibling", "when": "all"}},
    },
)
