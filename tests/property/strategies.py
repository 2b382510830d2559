"""Hypothesis strategies for RL batches: ragged groups, masks with holes, extreme logits,
zero-variance groups, all-masked sequences, and objective configs."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from megarl.batch import PackedBatch
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.testing.equivalence import Case
from reference import advantages as ref_adv


@st.composite
def packed_structure(
    draw,
    min_groups: int = 1,
    max_groups: int = 3,
    max_group_size: int = 4,
    max_response: int = 5,
    min_group_size: int = 1,
):
    """(prompt_lens, response_lens, group_ids, hole mask per response token)."""
    sizes = draw(
        st.lists(st.integers(min_group_size, max_group_size), min_size=min_groups, max_size=max_groups)
    )
    B = sum(sizes)
    group_ids = [g for g, n in enumerate(sizes) for _ in range(n)]
    prompt = draw(st.lists(st.integers(1, 3), min_size=B, max_size=B))
    resp = draw(st.lists(st.integers(0, max_response), min_size=B, max_size=B))
    holes = draw(st.lists(st.booleans(), min_size=sum(resp), max_size=sum(resp)))
    return prompt, resp, group_ids, holes


def build_batch(prompt, resp, group_ids, holes, V: int, rng: torch.Generator, dtype) -> PackedBatch:
    """A packed batch with random tokens and the mask (response tokens minus holes)."""
    B = len(prompt)
    lens = [p + r for p, r in zip(prompt, resp)]
    T = sum(lens)
    cu = torch.zeros(B + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    mask = torch.zeros(T, dtype=dtype)
    h = iter(holes)
    for i in range(B):
        for t in range(prompt[i], lens[i]):
            mask[int(cu[i]) + t] = 0.0 if next(h) else 1.0
    return PackedBatch(
        tokens=torch.randint(0, V, (T,), generator=rng),
        cu_seqlens=cu,
        prompt_lens=torch.tensor(prompt),
        loss_mask=mask,
        group_ids=torch.tensor(group_ids, dtype=torch.long),
    )


def objective_configs(
    policy_losses=("ppo", "gspo", "cispo", "dppo_tv", "dppo_kl"),
    distills=("none", "sampled_reverse_kl", "forward_kl", "reverse_kl", "jsd", "hellinger"),
):
    """Objective configs spanning every registered part."""
    return st.builds(
        ObjectiveConfig,
        policy_loss=st.sampled_from(policy_losses),
        dual_clip=st.sampled_from([None, 3.0]),
        aggregation=st.sampled_from(
            [
                "token-mean",
                "token-sum",
                "seq-mean-token-mean",
                "seq-mean-token-sum",
                "seq-mean-token-sum-norm",
            ]
        ),
        kl_coef=st.sampled_from([0.0, 0.1]),
        kl_estimator=st.sampled_from(["k1", "k2", "k3", "k3_k2grad"]),
        entropy_coef=st.sampled_from([0.0, 0.01]),
        correction=st.sampled_from(
            [
                "none",
                "tis",
                "mis",
                "icepop",
                "seq_geo_mask",
                "seq_tis",
                "token_k3",
                "seq_sum_k1",
                "seq_max_k2",
            ]
        ),
        correction_low=st.just(0.8),
        correction_high=st.just(1.25),
        distill=st.sampled_from(distills),
        distill_coef=st.just(0.5),
    )


@st.composite
def rl_cases(
    draw,
    dtype=torch.float64,
    vocab_sizes=(4, 8, 12, 16),
    cfgs=None,
    min_groups: int = 1,
    min_group_size: int = 1,
):
    """A full Case: batch with every per-token field, logits [T, V], teacher logits, config."""
    prompt, resp, group_ids, holes = draw(
        packed_structure(min_groups=min_groups, min_group_size=min_group_size)
    )
    V = draw(st.sampled_from(vocab_sizes))
    T = sum(prompt) + sum(resp)
    scale = draw(st.sampled_from([1.0, 4.0, 30.0]))  # 30: near one-hot softmax (extreme logits)
    logits_np = draw(arrays(np.float64, (T, V), elements=st.floats(-1, 1, allow_nan=False, width=32)))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = torch.Generator().manual_seed(seed)
    b = build_batch(prompt, resp, group_ids, holes, V, rng, dtype)
    logits = torch.tensor(logits_np * scale, dtype=dtype)
    logp = torch.log_softmax(logits.double(), -1).gather(-1, b.tokens.unsqueeze(-1)).squeeze(-1)

    def near(spread: float) -> torch.Tensor:  # a nearby valid log-prob per token
        return torch.clamp(
            logp + spread * (torch.rand(T, generator=rng, dtype=torch.float64) - 0.5), max=0.0
        ).to(dtype)

    b.old_logprobs = near(0.6)
    b.rollout_logprobs = near(0.6)
    b.ref_logprobs = near(1.0)
    b.teacher_logprobs = near(2.0)
    binary = draw(st.booleans())
    r = (
        torch.randint(0, 2, (b.num_seqs,), generator=rng).double()
        if binary
        else torch.randn(b.num_seqs, generator=rng, dtype=torch.float64)
    )
    b.rewards = r.to(dtype)
    adv_seq = ref_adv.grpo(r, b.group_ids)
    if draw(st.booleans()):
        adv = adv_seq[b.seq_index()]
    else:
        adv = torch.randn(T, generator=rng, dtype=torch.float64)
    b.advantages = (adv * b.loss_mask.double()).to(dtype)
    teacher = (torch.randn(T, V, generator=rng, dtype=torch.float64) * scale).to(dtype)
    cfg = draw(cfgs if cfgs is not None else objective_configs())
    return Case(batch=b, logits=logits, cfg=cfg, teacher_logits=teacher)
