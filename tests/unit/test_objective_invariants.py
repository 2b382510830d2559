"""Invariants of the core objectives (megarl and reference alike)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference.aggregation as ragg
import reference.kl as rkl
from megarl.objectives import corrections as mc
from megarl.objectives import kl as mkl
from megarl.objectives.aggregation import aggregate
from megarl.objectives.api import GlobalNormalisers
from megarl.objectives.policy_losses import POLICY_LOSSES

floats = st.floats(-3, 3, allow_nan=False, width=64)


def _grad_of(loss_name, logp, old, adv, **kw):
    lp = torch.tensor([logp], dtype=torch.float64, requires_grad=True)
    one = torch.ones(1, dtype=torch.float64)
    cu = torch.tensor([0, 1])
    loss = POLICY_LOSSES.get(loss_name)(
        lp, torch.tensor([old], dtype=torch.float64), torch.tensor([adv], dtype=torch.float64), one, cu, **kw
    )
    loss.sum().backward()
    return float(lp.grad)


@given(st.floats(-2, 2), st.floats(-5, -0.01), st.floats(0.05, 3))
def test_ppo_gradient_is_zero_outside_the_clip_region_in_the_advantage_direction(delta, old, a):
    eps_low, eps_high = 0.2, 0.28
    ratio = torch.exp(torch.tensor(delta)).item()
    if abs(ratio - (1 + eps_high)) < 1e-6 or abs(ratio - (1 - eps_low)) < 1e-6:
        return
    g_pos = _grad_of("ppo", old + delta, old, a, clip_low=eps_low, clip_high=eps_high)
    g_neg = _grad_of("ppo", old + delta, old, -a, clip_low=eps_low, clip_high=eps_high)
    # A > 0: no push once r > 1 + ε_high; A < 0: no push once r < 1 - ε_low
    assert (g_pos == 0) == (ratio > 1 + eps_high)
    assert (g_neg == 0) == (ratio < 1 - eps_low)
    if g_pos:
        assert g_pos < 0  # minimising the loss raises logp when A > 0
    if g_neg:
        assert g_neg > 0


@given(st.floats(-5, -0.01), st.floats(-2, 2), st.floats(0.05, 3))
def test_dual_clip_bounds_the_negative_advantage_loss(old, delta, a):
    lp = torch.tensor([old + delta], dtype=torch.float64)
    args = (
        lp,
        torch.tensor([old], dtype=torch.float64),
        torch.tensor([-a], dtype=torch.float64),
        torch.ones(1),
        torch.tensor([0, 1]),
    )
    loss = POLICY_LOSSES.get("ppo")(*args, 0.2, 0.28, 3.0)
    assert float(loss) <= 3.0 * a + 1e-12


@given(st.floats(-0.1, 0.1), st.floats(-5, -0.5), st.floats(0.05, 3))
def test_cispo_keeps_a_gradient_where_ppo_clips(delta, old, a):
    g = _grad_of("cispo", old + delta + 1.0, old, a, clip_low=0.2, clip_high=0.28)
    assert g < 0


@given(st.floats(-6, -0.01), st.floats(-2, 2), st.floats(0.1, 2))
def test_dppo_tv_zero_gradient_exactly_when_probability_moved_beyond_delta(old, delta, a):
    new = min(old + delta, -1e-6)
    moved = torch.exp(torch.tensor(new)) - torch.exp(torch.tensor(old))
    g = _grad_of("dppo_tv", new, old, a, clip_low=0.05, clip_high=0.05)
    assert (g == 0) == bool(moved > 0.05)


@given(st.lists(floats, min_size=1, max_size=20), st.lists(floats, min_size=1, max_size=20))
def test_k3_is_nonnegative(a, b):
    n = min(len(a), len(b))
    x, y = torch.tensor(a[:n]), torch.tensor(b[:n])
    assert torch.all(mkl.k3(x, y) >= 0)  # expm1: exactly non-negative
    # the reference writes the formula as read, exp(x) - x - 1, which rounds to -1 ulp of 1 near x = 0
    assert torch.all(rkl.kl_k3(x, y) >= -2 * torch.finfo(x.dtype).eps)


@given(st.lists(floats, min_size=1, max_size=10))
def test_k3_value_with_k2_gradient(vals):
    x = torch.tensor(vals, requires_grad=True)
    ref = torch.zeros_like(x)
    v = mkl.k3_value_k2_grad(x, ref)
    torch.testing.assert_close(v.detach(), mkl.k3(x.detach(), ref))
    v.sum().backward()
    torch.testing.assert_close(x.grad, x.detach())  # d/dx (x²/2) = x


@given(st.integers(1, 5), st.integers(1, 6), st.lists(floats, min_size=30, max_size=30))
def test_aggregation_modes_agree_on_uniform_lengths(B, n, vals):
    loss = (
        torch.tensor(vals[: B * n]).reshape(B, n) if B * n <= 30 else torch.randn(B, n, dtype=torch.float64)
    )
    mask = torch.ones(B, n)
    tm = ragg.aggregate(loss, mask, "token-mean")
    torch.testing.assert_close(ragg.aggregate(loss, mask, "seq-mean-token-mean"), tm)
    torch.testing.assert_close(ragg.aggregate(loss, mask, "seq-mean-token-sum"), n * tm)
    torch.testing.assert_close(ragg.aggregate(loss, mask, "seq-mean-token-sum-norm", max_len=n), tm)
    torch.testing.assert_close(ragg.aggregate(loss, mask, "token-sum"), B * n * tm)
    cu = torch.arange(B + 1) * n
    norm = GlobalNormalisers(num_tokens=B * n, num_seqs=B, max_response_len=n)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        torch.testing.assert_close(aggregate(loss.flatten(), mask.flatten(), cu, mode, norm), tm)


@pytest.mark.parametrize("name", ["tis", "mis", "icepop", "seq_geo_mask"])
@given(st.lists(st.floats(-0.2, 0.2), min_size=1, max_size=12))
def test_corrections_reduce_to_plain_is_when_nothing_triggers(name, gaps):
    # |log w| <= 0.2 keeps w inside [0.5, 2] (and the geometric mean too): no threshold triggers
    old = torch.full((len(gaps),), -1.0, dtype=torch.float64)
    roll = old - torch.tensor(gaps, dtype=torch.float64)
    cu = torch.tensor([0, len(gaps)])
    c = mc.CORRECTIONS.get(name)(old, roll, torch.ones(len(gaps)), cu, 0.5, 2.0)
    torch.testing.assert_close(c, torch.exp(old - roll))


def test_gspo_with_one_token_per_sequence_equals_ppo():
    g = torch.Generator().manual_seed(0)
    lp, old, adv = (torch.randn(6, generator=g, dtype=torch.float64) - 2 for _ in range(3))
    cu, m = torch.arange(7), torch.ones(6, dtype=torch.float64)
    torch.testing.assert_close(
        POLICY_LOSSES.get("gspo")(lp, old, adv, m, cu, 0.2, 0.28),
        POLICY_LOSSES.get("ppo")(lp, old, adv, m, cu, 0.2, 0.28),
    )
