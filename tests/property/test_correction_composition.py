"""Chained correction criteria, batch-normalised weights and the "drop" denominator: the composed
objective (prepared on every DP shard, TP 1/2, 1-3 micro-batches) equals reference/loss.py with
reference/corrections.py:rollout_correction in loss and logits gradient; plus their invariants
(normalised weights average to 1, a chain is the product of its keeps, dropping rejected tokens
gives the masked mean over the kept ones, the learner recounts the normalisers of a narrowed mask)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.objectives.api import GlobalNormalisers, LossContext, step_normalisers
from megarl.objectives.corrections import CORRECTIONS, CRITERIA
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective
from megarl.objectives.rollout_correction import DROPPED, MULTIPLIER, multiplier_and_keep
from megarl.testing.equivalence import (
    Case,
    megarl_loss_and_grad,
    reference_loss_and_grad,
    split_sequences,
)
from megarl.testing.simulated_group import SimulatedWorld
from tests.property.strategies import rl_cases

CHAINS = (
    [],
    [{"name": "token_k3", "high": 0.02}],
    [{"name": "seq_max_k2", "high": 0.03}, {"name": "token_k2", "high": 0.02}],
    [{"name": "icepop", "low": 0.9, "high": 1.15}, {"name": "seq_mean_k1", "high": 0.05}],
)


@st.composite
def composed_cfgs(draw):
    """A PPO objective with a correction, a chain, and the normalise / drop knobs drawn."""
    chain = draw(st.sampled_from(CHAINS))
    names = ["tis", "seq_tis", "mis", "token_k3", "seq_max_k2"] + (["none"] if chain else [])
    return ObjectiveConfig(
        policy_loss="ppo",
        aggregation=draw(st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])),
        kl_coef=draw(st.sampled_from([0.0, 0.1])),
        entropy_coef=draw(st.sampled_from([0.0, 0.01])),
        correction=draw(st.sampled_from(names)),
        correction_low=0.8,
        correction_high=1.25,
        correction_chain=chain,
        correction_normalise=draw(st.booleans()),
        correction_denominator=draw(st.sampled_from(["keep", "drop"])),
    )


def prepare_on_dp(case: Case, dp: int) -> Case:
    """``prepare`` on each contiguous DP shard (simulated DP group), the shards put back in order."""
    b = case.batch
    shards = split_sequences(b.num_seqs, dp)
    parts = SimulatedWorld(len(shards)).run(
        lambda r, g: build_objective(case.cfg).prepare(b.select(shards[r]), g)
    )

    def cat(field: str) -> dict:
        return {k: torch.cat([getattr(p, field)[k] for p in parts]) for k in getattr(parts[0], field)}

    merged = dataclasses.replace(
        b,
        loss_mask=torch.cat([p.loss_mask for p in parts]),
        extras=cat("extras"),
        token_extras=cat("token_extras"),
    )
    return dataclasses.replace(case, batch=merged)


@settings(max_examples=12, deadline=None)
@given(
    case=rl_cases(torch.float64, cfgs=composed_cfgs()),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_composed_correction_matches_reference(case, tp, dp, mb):
    ref_loss, ref_grad = reference_loss_and_grad(case)
    loss, grad = megarl_loss_and_grad(prepare_on_dp(case, dp), tp=tp, dp=dp, micro_batches=mb)
    zmax = max(1.0, float(case.logits.abs().max()))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-10 * max(zmax, float(ref_loss.abs())))
    gscale = max(zmax, float(ref_grad.abs().max()) if ref_grad.numel() else 1.0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-10 * gscale)


def _batch(seed: int = 0, spread: float = 0.3):
    from tests.property.strategies import build_batch

    g = torch.Generator().manual_seed(seed)
    b = build_batch([2, 1, 3, 2], [5, 4, 6, 3], [0, 0, 1, 1], [0, 1] + [0] * 15 + [1], 8, g, torch.float64)
    b.old_logprobs = -torch.rand(b.num_tokens, generator=g, dtype=torch.float64) * 2
    b.rollout_logprobs = b.old_logprobs + spread * torch.randn(b.num_tokens, generator=g, dtype=torch.float64)
    b.advantages = torch.randn(b.num_tokens, generator=g, dtype=torch.float64) * b.loss_mask
    return b


@pytest.mark.parametrize("name", ["tis", "seq_tis", "token_k3"])
@pytest.mark.parametrize("dp", [1, 2])
def test_normalised_weights_average_to_one(name, dp):
    b = _batch()
    cfg = ObjectiveConfig(correction=name, correction_high=1.5, correction_normalise=True)
    case = prepare_on_dp(Case(batch=b, logits=torch.zeros(b.num_tokens, 8), cfg=cfg), dp)
    c, m = case.batch.token_extras[MULTIPLIER], case.batch.loss_mask
    if name == "seq_tis":  # one weight per sequence: their mean over the sequences is 1
        seqs = [c[s:e][m[s:e] > 0] for s, e in zip(b.cu_seqlens[:-1].tolist(), b.cu_seqlens[1:].tolist())]
        mean = torch.stack([x.mean() for x in seqs if x.numel()]).mean()
    else:
        mean = (c * m).sum() / m.sum()
    torch.testing.assert_close(mean, torch.tensor(1.0, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    raw, _ = multiplier_and_keep(cfg, b.old_logprobs, b.rollout_logprobs, b.loss_mask, b.cu_seqlens)
    ratio = c[raw > 0] / raw[raw > 0]  # one global factor, the same on both DP shards
    torch.testing.assert_close(ratio, ratio[:1].expand_as(ratio), rtol=1e-12, atol=0)


def test_a_chain_is_the_product_of_its_keeps():
    b = _batch(1, spread=0.5)
    o, r, m, cu = b.old_logprobs, b.rollout_logprobs, b.loss_mask, b.cu_seqlens
    ka = CRITERIA["token_k3"](o, r, m, cu, 0.8, 0.05)
    kb = CRITERIA["seq_max_k2"](o, r, m, cu, 0.8, 0.15)
    assert 0 < int(ka.sum()) < o.numel() and 0 < int(kb.sum()) < o.numel()  # both bite, differently
    chain = [{"name": "token_k3", "high": 0.05}, {"name": "seq_max_k2", "high": 0.15}]
    c, keep = multiplier_and_keep(ObjectiveConfig(correction="none", correction_chain=chain), o, r, m, cu)
    assert torch.equal(keep, ka & kb) and torch.equal(c, (ka & kb).double())
    cfg = ObjectiveConfig(correction="token_k3", correction_high=0.05, correction_chain=chain[1:])
    c2, _ = multiplier_and_keep(cfg, o, r, m, cu)
    torch.testing.assert_close(c2, CORRECTIONS.get("token_k3")(o, r, m, cu, 0.8, 0.05) * kb.double())


def test_drop_is_the_masked_mean_over_kept_tokens():
    """Token-mean policy loss: drop = Σ_kept ℓ·c / N_kept, keep = the same numerator / N_all."""
    b = _batch(2, spread=0.5)
    out = {}
    for den in ("keep", "drop"):
        cfg = ObjectiveConfig(correction="token_k3", correction_high=0.05, correction_denominator=den)
        obj = build_objective(cfg)
        pb = obj.prepare(b, None)
        norms = step_normalisers(obj, pb, GlobalNormalisers.from_batch(b), None)
        logits = torch.randn(b.num_tokens, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        out[den] = (obj(logits, pb, LossContext(norms)), norms)
    (keep_out, n_all), (drop_out, n_kept) = out["keep"], out["drop"]
    assert n_kept.num_tokens < n_all.num_tokens and n_kept.max_response_len == n_all.max_response_len
    torch.testing.assert_close(drop_out.loss * n_kept.num_tokens, keep_out.loss * n_all.num_tokens)
    frac = 1 - n_kept.num_tokens / n_all.num_tokens
    torch.testing.assert_close(float(drop_out.metrics["correction_dropped_frac"]), frac)
    assert "correction_dropped_frac" not in keep_out.metrics


def test_step_normalisers_recount_only_a_narrowed_mask():
    b = _batch(2, spread=0.5)
    given = GlobalNormalisers(num_tokens=1e6, num_seqs=99.0, max_response_len=64.0)
    keep = build_objective(ObjectiveConfig(correction="token_k3", correction_high=0.05))
    assert not keep.narrows_loss_mask and step_normalisers(keep, keep.prepare(b), given) is given
    cfg = ObjectiveConfig(correction="token_k3", correction_high=0.05, correction_denominator="drop")
    shards = split_sequences(b.num_seqs, 2)

    def rank(r, g):
        obj = build_objective(cfg)
        return step_normalisers(obj, obj.prepare(b.select(shards[r]), g), given, g)

    got = SimulatedWorld(2).run(rank)
    whole = build_objective(cfg).prepare(b)
    assert got[0] == got[1] == GlobalNormalisers.from_batch(whole, None, 64.0)
    assert DROPPED in whole.extras and got[0].num_tokens < float(b.loss_mask.sum())


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"correction_chain": [{"name": "token_k9", "high": 1}]}, r"correction_chain\[0\]"),
        ({"correction_chain": [{"name": "mis", "high": 1, "hi": 2}]}, r"correction_chain\[0\] has unknown"),
        ({"correction_chain": [{"name": "mis", "high": "x"}]}, r"correction_chain\[0\]\.high"),
        ({"correction_denominator": "exclude"}, "correction_denominator"),
        ({"correction_normalise": True, "correction": "none"}, "need a correction"),
    ],
)
def test_bad_knobs_are_named(knobs, match):
    with pytest.raises(ValueError, match=match):
        ObjectiveConfig(**{"correction": "tis", **knobs}).validate()


def test_without_prepare_the_global_stage_is_refused():
    b = _batch()
    obj = build_objective(ObjectiveConfig(correction="tis", correction_normalise=True))
    with pytest.raises(ValueError, match="objective.prepare"):
        obj(
            torch.zeros(b.num_tokens, 8, dtype=torch.float64), b, LossContext(GlobalNormalisers.from_batch(b))
        )
