"""GAPO: megarl equals reference/trust_regions.py:gapo (loss and gradient, TP 1/2, DP 1/2,
micro-batches, PPO and GSPO surrogates) and the method's invariants."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.batch import from_sequences
from megarl.methods.trust_regions.gapo import gapo as gapo_loss
from megarl.methods.trust_regions.gapo import prepare
from megarl.objectives.rl_objective import ObjectiveConfig, resolved_clip
from megarl.testing.equivalence import megarl_loss_and_grad
from reference import trust_regions as ref
from reference.advantages import grpo
from tests.methods.trust_regions_harness import (
    aggregate,
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases

PPO_ARGS = st.fixed_dictionaries(
    {"kappa": st.sampled_from([0.0, 1.0, 2.0]), "adapt_low": st.booleans(), "surrogate": st.just("ppo")}
)
GSPO_ARGS = st.fixed_dictionaries(
    {
        "kappa": st.sampled_from([0.0, 1.0]),
        "adapt_low": st.booleans(),
        "surrogate": st.just("gspo"),
        "eps_min": st.just(1e-4),
        "eps_max": st.just(2e-3),
    }
)


@st.composite
def gapo_cfgs(draw):
    args = draw(PPO_ARGS | GSPO_ARGS)
    gspo = args["surrogate"] == "gspo"
    return ObjectiveConfig(
        policy_loss="gapo",
        policy_loss_args=args,
        clip_low=3e-4 if gspo else 0.2,
        clip_high=4e-4 if gspo else 0.28,
        dual_clip=None if gspo else draw(st.sampled_from([None, 3.0])),
        aggregation=draw(st.sampled_from(["token-mean", "seq-mean-token-mean", "token-sum"])),
    )


def _reference(case):
    cfg = case.cfg

    def fn(full, pad):
        logp, old, adv, mask = padded_inputs(full, pad)
        return aggregate(
            ref.gapo(
                logp,
                old,
                adv,
                mask,
                resolved_clip(cfg)["clip_low"],
                resolved_clip(cfg)["clip_high"],
                dual_clip=resolved_clip(cfg)["dual_clip"],
                **cfg.policy_loss_args,
            ),
            pad,
            cfg.aggregation,
        )

    return reference_method_loss_and_grad(case, fn)


@settings(max_examples=12)
@given(
    case=rl_cases(torch.float64, cfgs=gapo_cfgs()),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_matches_reference(case, tp, dp, mb):
    assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, mb), _reference(case), case.logits)


@settings(max_examples=6)
@given(case=rl_cases(torch.float64, cfgs=gapo_cfgs()))
def test_kappa_zero_is_fixed_clip_ppo_or_gspo(case):
    cfg = dataclasses.replace(case.cfg, policy_loss_args={**case.cfg.policy_loss_args, "kappa": 0.0})
    got = megarl_method_loss_and_grad(dataclasses.replace(case, cfg=cfg), tp=2, micro_batches=2)
    plain = dataclasses.replace(cfg, policy_loss=cfg.policy_loss_args["surrogate"], policy_loss_args={})
    want = megarl_loss_and_grad(dataclasses.replace(case, cfg=plain), tp=2, micro_batches=2)
    assert_equivalent(got, want, case.logits, rtol=1e-12, atol=1e-14)


@given(a=st.floats(0.01, 5), n=st.integers(1, 6), kappa=st.sampled_from([0.5, 1.0, 2.0]))
def test_constant_advantage_magnitude_keeps_the_base_bounds(a, n, kappa):
    adv = torch.tensor([[a] * n, [-a] * n], dtype=torch.float64)
    lo, hi = ref.gapo_clip_bounds(adv, torch.ones_like(adv), kappa=kappa)
    torch.testing.assert_close(hi, torch.full((2,), 0.28, dtype=torch.float64))
    torch.testing.assert_close(lo, torch.full((2,), 0.2, dtype=torch.float64))


@given(adv=st.lists(st.floats(-4, 4), min_size=2, max_size=8), kappa=st.sampled_from([0.5, 1.0, 2.0]))
def test_bounds_monotone_in_advantage_magnitude_and_within_limits(adv, kappa):
    b = from_sequences([[1]] * len(adv), [[2]] * len(adv), list(range(len(adv))))
    b.advantages = torch.tensor([x for a in adv for x in (0.0, a)], dtype=torch.float64)
    f = prepare(b, None, kappa=kappa).extras["gapo_scale"]
    hi = torch.clamp(0.28 * f, 0.1, 1.0)
    mag = torch.tensor(adv, dtype=torch.float64).abs()
    order = torch.argsort(mag)
    assert torch.all(hi[order][1:] >= hi[order][:-1])
    assert torch.all((hi >= 0.1) & (hi <= 1.0))
    _, hi_r = ref.gapo_clip_bounds(
        torch.tensor(adv, dtype=torch.float64)[:, None], torch.ones(len(adv), 1), kappa=kappa
    )
    torch.testing.assert_close(hi, hi_r)


def test_rare_correct_rollouts_get_more_headroom():
    """Binary rewards with GRPO advantages: A+ = sqrt((1−p̂)/p̂)·c grows as p̂ → 0."""
    rewards = torch.tensor([1.0] + [0.0] * 7 + [1.0] * 4 + [0.0] * 4, dtype=torch.float64)
    gid = torch.tensor([0] * 8 + [1] * 8)
    b = from_sequences([[1]] * 16, [[2]] * 16, gid.tolist())
    b.advantages = torch.repeat_interleave(grpo(rewards, gid), 2) * b.loss_mask
    f = prepare(b, None).extras["gapo_scale"]
    assert f[0] > f[8] > 0  # the lone correct rollout vs a correct one in a half-correct group


def _tokens_grad(surrogate, lr, adv, seqs):
    b = from_sequences([[1]] * len(seqs), [[2] * n for n in seqs], list(range(len(seqs))))
    T = b.num_tokens
    b.advantages = adv
    b = prepare(b, None)
    x = lr.clone().requires_grad_(True)
    loss = gapo_loss(
        x,
        torch.zeros(T, dtype=torch.float64),
        adv,
        b.loss_mask.double(),
        b.cu_seqlens,
        batch=b,
        surrogate=surrogate,
        eps_min=1e-4 if surrogate == "gspo" else 0.1,
        clip_low=3e-4 if surrogate == "gspo" else 0.2,
        clip_high=4e-4 if surrogate == "gspo" else 0.28,
    )
    (loss * b.loss_mask).sum().backward()
    return x.grad, b


def test_inside_the_band_the_gradient_is_the_importance_weighted_one():
    adv = torch.tensor([0, 1.0, -2.0, 0, 0.5], dtype=torch.float64)
    lr = torch.tensor([0, 0.05, -0.05, 0, 0.1], dtype=torch.float64)
    g, b = _tokens_grad("ppo", lr, adv, [2, 1])
    torch.testing.assert_close(g * b.loss_mask, -adv * torch.exp(lr) * b.loss_mask)


def test_gspo_mode_shares_the_clip_decision_within_a_sequence():
    adv = torch.tensor([0, 1.0, 1.0, 1.0, 0, 1.0, 1.0], dtype=torch.float64)
    lr = torch.tensor([0, 0.5, 0.4, 0.6, 0, -1e-5, 0.0], dtype=torch.float64)  # seq 0 out of band, seq 1 in
    g, _ = _tokens_grad("gspo", lr, adv, [3, 2])
    assert torch.all(g[1:4] == 0) and torch.all(g[5:7] != 0)


def test_missing_prepare_is_named():
    b = from_sequences([[1]], [[2]], [0])
    with pytest.raises(ValueError, match="objective.prepare"):
        gapo_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), b.loss_mask, b.cu_seqlens, batch=b)
