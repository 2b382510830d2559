"""Shared checks of the teacher-shaped advantage estimators (Distilled RL, OPD regulation, RA-OPD,
OPDVR/GRPD): teacher logprobs from vocab-parallel teacher logits (TP 1 or 2), the estimator on the
whole packed batch (as the trainer runs it, before the data-parallel split), then megarl's PPO
objective (TP-sharded, DP-split, micro-batched) against a padded reference written from
reference/distillation.py, in loss and logits gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from hypothesis import strategies as st

from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.batch import PackedBatch, PaddedBatch, unpack
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.ops.vocab_parallel import vocab_parallel_logprobs
from megarl.testing.equivalence import Case
from megarl.testing.simulated_group import SimulatedWorld
from reference.aggregation import aggregate
from reference.logprobs import token_logprobs
from reference.policy_losses import ppo_clip
from tests.methods.trust_regions_harness import (
    assert_equivalent,
    megarl_method_loss_and_grad,
    reference_method_loss_and_grad,
)
from tests.property.test_advantages import reward_batches

AGGS = ("token-mean", "seq-mean-token-mean", "token-sum", "seq-mean-token-sum")


@st.composite
def ppo_cfgs(draw):
    """PPO objectives with the aggregations the reference computes without a length constant."""
    return ObjectiveConfig(
        policy_loss="ppo",
        clip_low=0.2,
        clip_high=draw(st.sampled_from([0.2, 0.28])),
        aggregation=draw(st.sampled_from(AGGS)),
    )


def with_teacher_logprobs(case: Case, tp: int) -> Case:
    """The case whose ``teacher_logprobs`` come from its teacher logits sharded over ``tp`` ranks."""
    t = case.teacher_logits
    lps = SimulatedWorld(tp).run(
        lambda r, g: vocab_parallel_logprobs(t.chunk(tp, -1)[r], case.batch.tokens, g if tp > 1 else None, 3)
    )
    for lp in lps[1:]:
        assert torch.equal(lp, lps[0])  # every TP rank holds the same sampled-token logprobs
    return dataclasses.replace(case, batch=dataclasses.replace(case.batch, teacher_logprobs=lps[0]))


def estimated(case: Case, name: str, **knobs) -> Case:
    """The case with ``batch.advantages`` from estimator ``name`` (which may clear loss-mask entries)."""
    b = dataclasses.replace(case.batch)
    b.advantages = ADVANTAGE_ESTIMATORS.get(name)(b, **knobs).to(case.logits.dtype)
    return dataclasses.replace(case, batch=b)


def padded_teacher(case: Case, pad: PaddedBatch) -> torch.Tensor:
    """Reference teacher logprobs [B, L] from the full teacher logits."""
    full = torch.zeros(pad.attention_mask.shape + (case.teacher_logits.shape[-1],), dtype=case.logits.dtype)
    full[pad.attention_mask] = case.teacher_logits
    return token_logprobs(full, pad.tokens)


def reference_loss(
    case: Case,
    ref_adv: Callable[[PaddedBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
):
    """Reference (loss, grad [T, V]): ``ref_adv(pad, teacher_logp, old_logp) -> (adv, loss_mask)``
    [B, L] each, then PPO-clip aggregated with the case's mode."""
    cfg = case.cfg

    def fn(full, pad):
        old = pad.per_token["old_logprobs"]
        adv, mask = ref_adv(pad, padded_teacher(case, pad), old)
        logp = token_logprobs(full, pad.tokens)
        return aggregate(ppo_clip(logp, old, adv, cfg.clip_low, cfg.clip_high), mask, cfg.aggregation)

    return reference_method_loss_and_grad(case, fn)


def check_equivalent(case: Case, tp: int, dp: int, mb: int, name: str, knobs: dict, ref_adv) -> None:
    """megarl (teacher at TP ``tp``, estimator, objective at TP/DP/micro-batches) equals the reference."""
    case = with_teacher_logprobs(case, tp)
    got = megarl_method_loss_and_grad(estimated(case, name, **knobs), tp, dp, min(mb, case.batch.num_seqs))
    assert_equivalent(got, reference_loss(case, ref_adv), case.logits)


def seq_rewards(pad: PaddedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards [B] float64, group_ids [B]) of a padded batch."""
    return pad.per_seq["rewards"].double(), pad.per_seq["group_ids"]


@st.composite
def teacher_batches(draw):
    """Reward batches (binary, Gaussian or constant rewards) with behaviour and teacher logprobs
    of the sampled tokens; spreads up to 12 nats so every clip and gate is reached."""
    b = draw(reward_batches())
    spread = draw(st.sampled_from([0.5, 3.0, 12.0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    b.old_logprobs = -torch.rand(b.num_tokens, generator=g, dtype=torch.float64) * spread
    b.teacher_logprobs = -torch.rand(b.num_tokens, generator=g, dtype=torch.float64) * spread
    return b


def padded_inputs(b: PackedBatch):
    """(pad, teacher_logp, old_logp, mask) of a packed batch, padded."""
    pad = unpack(b)
    return pad, pad.per_token["teacher_logprobs"], pad.per_token["old_logprobs"], pad.loss_mask


def packed_of(b: PackedBatch, padded: torch.Tensor) -> torch.Tensor:
    """A padded [B, L] tensor back on the packed tokens [T]."""
    return padded[unpack(b).attention_mask]
