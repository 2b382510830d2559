"""ESTR: megarl (entropy from the vocab-parallel training forward) equals
reference/trust_regions.py:estr (loss and gradient, TP 1/2, DP 1/2, micro-batches) and the method's
invariants."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megarl.batch import from_sequences
from megarl.methods.trust_regions.estr import calibrate_kappa
from megarl.methods.trust_regions.estr import estr as estr_loss
from megarl.objectives import rl_objective
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective
from reference import trust_regions as ref
from reference.logprobs import entropy as ref_entropy
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
    policy_loss=st.just("estr"),
    aggregation=st.sampled_from(["token-mean", "seq-mean-token-mean"]),
    policy_loss_args=st.fixed_dictionaries(
        {
            "eps": st.sampled_from([0.1, 0.5, 2.0]),
            "kappa": st.sampled_from([0.5, 1.0]),
            "h_min": st.sampled_from([0.05, 0.5]),
            "is_cap": st.sampled_from([1.5, 2.0]),
        }
    ),
)


def _reference(case):
    cfg = case.cfg

    def fn(full, pad):
        logp, _, adv, _ = padded_inputs(full, pad)
        H = ref_entropy(full)
        return aggregate(
            ref.estr(logp, pad.per_token["rollout_logprobs"], H, adv, **cfg.policy_loss_args),
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


def _call(logp, behav, H, adv, **kw):
    T = logp.numel()
    b = from_sequences([[1]], [[2] * (T - 1)], [0])
    b.rollout_logprobs = behav
    return estr_loss(logp, behav, adv, b.loss_mask.double(), b.cu_seqlens, batch=b, entropy=H, **kw)


@given(
    H=st.floats(0.0, 5.0),
    eps=st.floats(0.05, 1.0),
    kappa=st.sampled_from([0.5, 1.0]),
    d=st.lists(st.floats(-2, 2), min_size=1, max_size=8),
)
def test_constant_entropy_is_a_magnitude_mask(H, eps, kappa, d):
    delta = torch.tensor(d, dtype=torch.float64)
    logp = torch.full_like(delta, -1.0)
    adv = torch.ones_like(delta)
    eps_prime = eps * max(H, 0.05) ** kappa
    # the loss sees logp - (logp - delta), which may differ from delta in the last bit: keep
    # deviations that sit on the bound itself out of an exact mask comparison
    assume(bool(((delta.abs() - eps_prime).abs() > 1e-9).all()))
    got = _call(logp, logp - delta, torch.full_like(delta, H), adv, eps=eps, kappa=kappa, is_cap=1e9)
    want = -(delta.abs() <= eps_prime).double() * torch.exp(delta) * adv * logp
    torch.testing.assert_close(got, want)


@given(d=st.floats(-3, 3), h1=st.floats(0, 4), h2=st.floats(0, 4), kappa=st.sampled_from([0.5, 1.0]))
def test_higher_entropy_never_masks_a_kept_token(d, h1, h2, kappa):
    lo, hi = sorted([h1, h2])
    logp = torch.tensor([-1.0], dtype=torch.float64)
    behav = logp - d
    kept = [
        bool(_call(logp, behav, torch.tensor([h], dtype=torch.float64), torch.ones(1), kappa=kappa) != 0)
        for h in (lo, hi)
    ]
    assert kept[1] or not kept[0]


def test_on_policy_keeps_every_token_and_is_the_plain_policy_gradient():
    logp0 = torch.tensor([-0.5, -2.0, -1.0, -0.1], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    x = logp0.clone().requires_grad_(True)
    _call(x, logp0, torch.zeros(4, dtype=torch.float64), adv).sum().backward()
    torch.testing.assert_close(x.grad, -adv)


def test_uses_only_the_existing_forward(monkeypatch):
    """One vocab-parallel pass per objective call (no extra forward for the entropy)."""
    calls = []
    real = rl_objective.vocab_parallel_logprobs_entropy
    monkeypatch.setattr(
        rl_objective, "vocab_parallel_logprobs_entropy", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    b = from_sequences([[1], [2]], [[3, 4], [5]], [0, 1])
    b.advantages = torch.ones(5, dtype=torch.float64)
    b.rollout_logprobs = torch.full((5,), -1.5, dtype=torch.float64)
    out = build_objective({"policy_loss": "estr"})(
        torch.randn(5, 8, dtype=torch.float64), b, LossContext(GlobalNormalisers(3, 2, 2))
    )
    assert len(calls) == 1 and torch.isfinite(out.loss)
    assert {"estr/masked_frac", "estr/deviation_abs"} <= set(out.metrics)


@given(kappa=st.floats(0.3, 1.5), c=st.floats(0.01, 1.0))
@settings(max_examples=20)
def test_calibration_recovers_the_entropy_exponent(kappa, c):
    H = torch.linspace(0.1, 3.0, 50, dtype=torch.float64)
    delta = c * H**kappa * torch.where(torch.arange(50) % 2 == 0, 1.0, -1.0).double()
    assert calibrate_kappa(delta, H, torch.ones(50)) == pytest.approx(kappa, rel=1e-9)


def test_bad_knob_is_named():
    with pytest.raises(ValueError, match="policy_loss_args.eps"):
        _call(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.ones(2), eps=0.0)
