"""Clip-Cov and KL-Cov: megarl equals reference/peers.py (loss and gradient: TP 1/2, micro-batches,
packed vs padded; DP 1/2 where the selection is deterministic) and the methods' invariants."""

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.peers as rp
from megarl.batch import unpack
from megarl.methods.peers.cov import CovDraws, prepare_clip_cov, prepare_kl_cov, token_keys
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective
from megarl.testing.equivalence import megarl_loss_and_grad
from tests.methods.trust_regions_harness import (
    aggregate,
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    prepare_on_dp_ranks,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases

AGGS = st.sampled_from(["token-mean", "seq-mean-token-mean", "token-sum"])
# (cov_low, cov_high): verl's band, a wide band, one side only, an empty band
BANDS = st.sampled_from([(1.0, 5.0), (-10.0, 10.0), (0.0, 10.0), (-10.0, 0.0), (5.0, 1.0)])


@st.composite
def clip_cov_cfgs(draw, ratios=(2e-4, 0.1, 0.5, 1.0)):
    lo, hi = draw(BANDS)
    args = {
        "ratio": draw(st.sampled_from(ratios)),
        "cov_low": lo,
        "cov_high": hi,
        "seed": draw(st.integers(0, 9)),
    }
    return ObjectiveConfig(
        policy_loss="clip_cov",
        clip_low=draw(st.sampled_from([None, 0.1, 0.2])),
        clip_high=draw(st.sampled_from([None, 0.2, 0.28])),
        aggregation=draw(AGGS),
        policy_loss_args=args,
    )


@st.composite
def kl_cov_cfgs(draw):
    args = {
        "ratio": draw(st.sampled_from([2e-4, 0.05, 0.2, 1.0])),
        "kl_coef": draw(st.sampled_from([0.0, 1.0, 3.0])),
    }
    return ObjectiveConfig(policy_loss="kl_cov", aggregation=draw(AGGS), policy_loss_args=args)


def _padded(x_tokens, pad):
    out = torch.zeros(pad.attention_mask.shape, dtype=x_tokens.dtype)
    out[pad.attention_mask] = x_tokens
    return out


def _clip_cov_reference(case):
    """The keys are megarl's draw for DP 1 (a fresh objective's first draw): the same uniform numbers
    given to the reference, whose selection rule and loss are its own."""
    cfg, args = case.cfg, case.cfg.policy_loss_args
    seeds = prepare_clip_cov(case.batch, None, CovDraws(seed=args["seed"]), **args).extras["clip_cov_seed"]
    keys = token_keys(seeds, case.batch.cu_seqlens)
    lo = 0.2 if cfg.clip_low is None else cfg.clip_low
    hi = 0.2 if cfg.clip_high is None else cfg.clip_high

    def fn(full, pad):
        logp, old, adv, mask = padded_inputs(full, pad)
        cov = rp.token_covariance(adv, old, mask)
        sel = rp.clip_cov_selected(
            cov, mask, _padded(keys, pad), args["ratio"], args["cov_low"], args["cov_high"]
        )
        return aggregate(rp.clip_cov(logp, old, adv, sel, lo, hi), pad, cfg.aggregation)

    return reference_method_loss_and_grad(case, fn)


def _kl_cov_reference(case):
    args = case.cfg.policy_loss_args

    def fn(full, pad):
        logp, old, adv, mask = padded_inputs(full, pad)
        sel = rp.kl_cov_selected(rp.token_covariance(adv, old, mask), mask, args["ratio"])
        return aggregate(rp.kl_cov(logp, old, adv, sel, args["kl_coef"]), pad, case.cfg.aggregation)

    return reference_method_loss_and_grad(case, fn)


@settings(max_examples=15)
@given(case=rl_cases(torch.float64, cfgs=clip_cov_cfgs()), tp=st.sampled_from([1, 2]), mb=st.integers(1, 3))
def test_clip_cov_matches_reference(case, tp, mb):
    assert_equivalent(megarl_method_loss_and_grad(case, tp, 1, mb), _clip_cov_reference(case), case.logits)


@settings(max_examples=10)
@given(case=rl_cases(torch.float64, cfgs=clip_cov_cfgs(ratios=(1.0,))), mb=st.integers(1, 3))
def test_clip_cov_data_parallel_selects_every_candidate_when_k_covers_them(case, mb):
    """ratio 1: k = N ≥ #candidates, p = 1, the selection is deterministic and the global means and
    counts of two DP ranks give the one-rank result."""
    assert_equivalent(megarl_method_loss_and_grad(case, 2, 2, mb), _clip_cov_reference(case), case.logits)


@settings(max_examples=10)
@given(case=rl_cases(torch.float64, cfgs=clip_cov_cfgs()))
def test_clip_cov_with_an_empty_band_is_ppo_clip(case):
    args = {**case.cfg.policy_loss_args, "cov_low": 5.0, "cov_high": 1.0}
    cfg = dataclasses.replace(case.cfg, policy_loss_args=args)
    got = megarl_method_loss_and_grad(dataclasses.replace(case, cfg=cfg), tp=2, micro_batches=2)
    ppo = dataclasses.replace(
        cfg,
        policy_loss="ppo",
        policy_loss_args={},
        clip_low=0.2 if cfg.clip_low is None else cfg.clip_low,
        clip_high=0.2 if cfg.clip_high is None else cfg.clip_high,
    )
    want = megarl_loss_and_grad(dataclasses.replace(case, cfg=ppo), tp=2, micro_batches=2)
    assert_equivalent(got, want, case.logits, rtol=1e-12, atol=1e-14)


@settings(max_examples=20)
@given(case=rl_cases(torch.float64, cfgs=clip_cov_cfgs()))
def test_clip_cov_selected_tokens_have_no_gradient_and_the_draw_is_checkpointed(case):
    prepared, (obj,) = prepare_on_dp_ranks(case, 1)
    args = case.cfg.policy_loss_args
    from megarl.methods.peers.cov import clip_cov_selected

    sel = clip_cov_selected(prepared.batch, args["cov_low"], args["cov_high"])
    _, grad = megarl_loss_and_grad(prepared, tp=1, objective=obj)
    assert torch.all(grad[sel] == 0)
    assert obj.state_dict() == {"policy_loss": {"seed": args["seed"], "draws": 1}}
    again = build_objective(case.cfg)
    again.load_state_dict(obj.state_dict())
    b1 = obj.prepare(case.batch)
    b2 = again.prepare(case.batch)
    assert torch.equal(b1.extras["clip_cov_seed"], b2.extras["clip_cov_seed"])


def test_clip_cov_draws_about_k_tokens():
    """Over many draws the mean number of selected candidates is k = ⌊ratio·N⌋ (verl draws exactly k)."""
    g = torch.Generator().manual_seed(0)
    B, L = 64, 16
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, L)
    old = -torch.rand(B, L, generator=g, dtype=torch.float64) * 4
    mask = torch.ones(B, L, dtype=torch.bool)
    cov = rp.token_covariance(adv, old, mask)
    ratio = 0.01  # k = 10 of 1024 tokens
    cand = int(((cov > 0) & (cov < 10)).sum())
    assert cand > 100
    counts = [
        int(
            rp.clip_cov_selected(
                cov, mask, torch.rand(B, L, generator=g, dtype=torch.float64), ratio, 0.0, 10.0
            ).sum()
        )
        for _ in range(400)
    ]
    assert abs(sum(counts) / len(counts) - 10) < 0.5


@settings(max_examples=15)
@given(
    case=rl_cases(torch.float64, cfgs=kl_cov_cfgs()),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_kl_cov_matches_reference(case, tp, dp, mb):
    assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, mb), _kl_cov_reference(case), case.logits)


@settings(max_examples=10)
@given(case=rl_cases(torch.float64, cfgs=kl_cov_cfgs()))
def test_kl_cov_without_penalty_is_the_unclipped_surrogate(case):
    cfg = dataclasses.replace(case.cfg, policy_loss_args={**case.cfg.policy_loss_args, "kl_coef": 0.0})
    got = megarl_method_loss_and_grad(dataclasses.replace(case, cfg=cfg), tp=2, micro_batches=2)
    ppo = dataclasses.replace(cfg, policy_loss="ppo", policy_loss_args={}, clip_low=1e9, clip_high=1e9)
    want = megarl_loss_and_grad(dataclasses.replace(case, cfg=ppo), tp=2, micro_batches=2)
    assert_equivalent(got, want, case.logits, rtol=1e-12, atol=1e-14)


@settings(max_examples=15)
@given(case=rl_cases(torch.float64, cfgs=kl_cov_cfgs()), dp=st.sampled_from([1, 2, 3]))
def test_kl_cov_selects_the_k_largest_covariances_of_the_global_batch(case, dp):
    """Split over DP ranks, the selected tokens are the global top k (covariances are distinct)."""
    from megarl.methods.peers.cov import kl_cov_selected

    prepared, _ = prepare_on_dp_ranks(case, dp)
    b = prepared.batch
    sel = kl_cov_selected(b)
    n = int(b.loss_mask.sum())
    k = max(int(case.cfg.policy_loss_args["ratio"] * n), 1) if n else 0
    pad = unpack(b)
    old = pad.per_token["old_logprobs"]
    cov = rp.token_covariance(pad.per_token["advantages"], old, pad.loss_mask)[pad.loss_mask.bool()]
    if cov.unique().numel() == cov.numel():
        assert int(sel.sum()) == k
    ref = rp.kl_cov_selected(
        rp.token_covariance(pad.per_token["advantages"], old, pad.loss_mask),
        pad.loss_mask,
        case.cfg.policy_loss_args["ratio"],
    )
    assert torch.equal(sel, ref[pad.attention_mask])
    assert prepare_kl_cov(case.batch, None, ratio=1.0).extras["kl_cov_tau"].numel() == case.batch.num_seqs
