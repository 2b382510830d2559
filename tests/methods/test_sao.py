"""SAO strict double-sided clipping: megarl equals reference/trust_regions.py:sao_clip (loss and
gradient, TP 1/2, DP 1/2, micro-batches) and the method's invariants."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.batch import from_sequences
from megarl.methods.trust_regions.sao import sao_clip as sao_loss
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.policy_losses import ppo
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective, resolved_clip
from reference import trust_regions as ref
from tests.methods.trust_regions_harness import (
    aggregate,
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases

CFGS = st.builds(
    ObjectiveConfig,
    policy_loss=st.just("sao_clip"),
    clip_low=st.sampled_from([0.2, 0.1]),
    clip_high=st.sampled_from([0.28, 0.1]),
    aggregation=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
    policy_loss_args=st.sampled_from([{}, {"max_out_of_band": 0.0}, {"max_out_of_band": 0.3}]),
)


def _reference(case):
    cfg = case.cfg

    def fn(full, pad):
        logp, _, adv, _ = padded_inputs(full, pad)
        return aggregate(
            ref.sao_clip(
                logp,
                pad.per_token["rollout_logprobs"],
                adv,
                resolved_clip(cfg)["clip_low"],
                resolved_clip(cfg)["clip_high"],
                pad.loss_mask,
                cfg.policy_loss_args.get("max_out_of_band"),
            ),
            pad,
            cfg.aggregation,
        )

    return reference_method_loss_and_grad(case, fn)


@settings(max_examples=12)
@given(
    case=rl_cases(torch.float64, cfgs=CFGS),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_matches_reference(case, tp, dp, mb):
    assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, mb), _reference(case), case.logits)


def _grad(lr, adv, fn=sao_loss):
    T = lr.numel()
    b = from_sequences([[1]], [[2] * (T - 1)], [0])
    b.rollout_logprobs = torch.zeros(T, dtype=torch.float64)
    x = lr.clone().requires_grad_(True)
    kw = {"batch": b} if fn is sao_loss else {}
    fn(x, torch.zeros(T, dtype=torch.float64), adv, b.loss_mask, b.cu_seqlens, **kw).sum().backward()
    return x.grad


@given(lr=st.floats(0.3, 3.0) | st.floats(-3.0, -0.3), a=st.floats(0.1, 5) | st.floats(-5, -0.1))
def test_out_of_band_tokens_get_zero_gradient_for_both_signs(lr, a):
    assert _grad(torch.tensor([lr]), torch.tensor([a], dtype=torch.float64)).item() == 0.0


def test_ppo_keeps_the_pessimistic_side_sao_does_not():
    lr, adv = torch.tensor([0.5], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)
    assert _grad(lr, adv, fn=ppo).item() != 0.0 and _grad(lr, adv).item() == 0.0


@given(lrs=st.lists(st.floats(-0.2, 0.2), min_size=1, max_size=6), a=st.floats(-5, 5))
def test_inside_the_band_it_is_the_importance_weighted_gradient(lrs, a):
    lr = torch.tensor(lrs, dtype=torch.float64).clamp(min=-0.1, max=0.1)  # inside [log 0.8, log 1.28]
    adv = torch.full_like(lr, a)
    torch.testing.assert_close(_grad(lr, adv), -adv * torch.exp(lr))


def test_synchronous_data_gives_reinforce_with_baseline():
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    torch.testing.assert_close(_grad(torch.zeros(3, dtype=torch.float64), adv), -adv)


def test_single_rollout_per_prompt_needs_no_group_statistics():
    """G = 1: every sequence its own group, A = R − V; each sequence's loss ignores the others."""
    b = from_sequences([[1], [2], [3]], [[4, 5], [6], [7, 8]], [0, 1, 2])
    R, V = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0.4, 0.3, 0.9])
    b.advantages = torch.repeat_interleave((R - V).double(), b.seq_lens) * b.loss_mask
    logits = torch.randn(b.num_tokens, 9, dtype=torch.float64)
    b.rollout_logprobs = torch.log_softmax(logits, -1)[torch.arange(b.num_tokens), b.tokens] * b.loss_mask
    obj = build_objective({"policy_loss": "sao_clip", "aggregation": "token-sum"})
    ctx = LossContext(GlobalNormalisers(5, 3, 2))
    whole = obj(logits, b, ctx).loss
    parts = sum(obj(logits[b.cu_seqlens[i] : b.cu_seqlens[i + 1]], b.select([i]), ctx).loss for i in range(3))
    torch.testing.assert_close(whole, parts)
    assert "sao_clip/out_of_band_frac" in obj(logits, b, ctx).metrics


@given(b0=st.floats(-3, 3), seed=st.integers(0, 100))
@settings(max_examples=20)
def test_value_baseline_does_not_change_the_expected_gradient(b0, seed):
    """Softmax bandit, exact expectation over actions at r = 1: Σ_a π(a)·∇ℓ(a; A = R(a) − b)."""
    g = torch.Generator().manual_seed(seed)
    z, R = torch.randn(5, generator=g, dtype=torch.float64), torch.rand(5, generator=g, dtype=torch.float64)

    def expected_grad(baseline):
        zz = z.clone().requires_grad_(True)
        logp = torch.log_softmax(zz, 0)
        b = from_sequences([[1]] * 5, [[2]] * 5, list(range(5)))
        behav = torch.zeros(10, dtype=torch.float64)
        behav[1::2] = logp.detach()
        b.rollout_logprobs = behav
        lp = torch.zeros(10, dtype=torch.float64).index_put((torch.arange(1, 10, 2),), logp)
        adv = torch.zeros(10, dtype=torch.float64)
        adv[1::2] = R - baseline
        per_tok = sao_loss(lp, behav, adv, b.loss_mask, b.cu_seqlens, batch=b)[1::2]
        (logp.detach().exp() * per_tok).sum().backward()
        return zz.grad

    torch.testing.assert_close(expected_grad(b0), expected_grad(0.0), rtol=1e-10, atol=1e-12)


def test_needs_advantages():
    b = from_sequences([[1]], [[2]], [0])
    with pytest.raises(ValueError, match="advantages"):
        build_objective({"policy_loss": "sao_clip"})(
            torch.randn(2, 4), b, LossContext(GlobalNormalisers(1, 1))
        )


def test_sequence_mask_drops_whole_sequences_past_the_share():
    """max_out_of_band: a sequence with more out-of-band loss tokens than the share gets zero loss
    and gradient on every token; the others are the token-level loss; 1.0 is the token-level loss."""
    b = from_sequences([[1], [1]], [[2, 2, 2, 2], [2, 2, 2, 2]], [0, 1])
    T = b.num_tokens
    b.rollout_logprobs = torch.zeros(T, dtype=torch.float64)
    lr = torch.zeros(T, dtype=torch.float64)
    lr[2] = 1.0  # one of 4 response tokens of sequence 0 out of band (r = e)
    lr[7], lr[8] = 1.0, -1.0  # two of 4 of sequence 1
    adv = torch.ones(T, dtype=torch.float64) * b.loss_mask

    def grad(share):
        x = lr.clone().requires_grad_(True)
        knobs = {} if share is None else {"max_out_of_band": share}
        sao_loss(x, lr * 0, adv, b.loss_mask, b.cu_seqlens, batch=b, **knobs).sum().backward()
        return x.grad

    token = grad(None)
    assert torch.equal(grad(1.0), token)
    g = grad(0.3)  # sequence 0 (1/4 out) stays, sequence 1 (2/4 out) goes
    assert torch.equal(g[:5], token[:5]) and torch.equal(g[5:], torch.zeros(5, dtype=torch.float64))
    assert torch.equal(grad(0.0), torch.zeros(T, dtype=torch.float64))
    with pytest.raises(ValueError, match="max_out_of_band"):
        grad(1.5)
