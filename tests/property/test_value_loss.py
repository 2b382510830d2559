"""megarl's value loss (objectives/value_losses.py) equals reference/critics.py: loss and gradient
w.r.t. the values, packed vs padded, whole batch vs micro-batches and data-parallel shards summed
under the global normaliser; and the invariants of the three kinds."""

import itertools

import torch
from hypothesis import given
from hypothesis import strategies as st

from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.value_losses import ValueObjective, value_loss_per_token
from reference.critics import bounded_values, value_loss
from tests.property.strategies import build_batch, packed_structure

KINDS = st.sampled_from(["mse", "clipped", "huber"])


def _case(data, dtype=torch.float64):
    prompt, resp, gids, holes = data.draw(packed_structure(max_groups=4))
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = torch.Generator().manual_seed(seed)
    b = build_batch(prompt, resp, gids, holes, 7, rng, dtype)
    T = b.num_tokens
    scale = data.draw(st.sampled_from([0.1, 1.0, 5.0]))
    b.values = scale * torch.randn(T, generator=rng, dtype=dtype)  # V_old
    b.returns = scale * torch.randn(T, generator=rng, dtype=dtype)
    v = b.values + scale * torch.randn(T, generator=rng, dtype=dtype)  # the critic's values now
    return b, v


def _padded(b, x):
    """[T] packed -> [B, L] padded (0 outside each sequence)."""
    cu = b.cu_seqlens.tolist()
    L = max(cu[i + 1] - cu[i] for i in range(len(cu) - 1))
    out = torch.zeros(len(cu) - 1, L, dtype=x.dtype)
    for i in range(len(cu) - 1):
        out[i, : cu[i + 1] - cu[i]] = x[cu[i] : cu[i + 1]]
    return out


def _megarl(b, v, kind, clip, delta, shards: int):
    """Sum of the objective's contributions over ``shards`` contiguous splits of the batch."""
    v = v.clone().requires_grad_(True)
    norms = GlobalNormalisers.from_batch(b)
    ctx = LossContext(normalisers=norms)
    obj = ValueObjective(kind, clip, delta)
    total = v.new_zeros(())
    seqs = b.num_seqs
    bounds = torch.linspace(0, seqs, shards + 1).round().long().tolist()
    for lo, hi in itertools.pairwise(bounds):
        if hi <= lo:
            continue
        part = b.select(list(range(lo, hi)))
        t0, t1 = int(b.cu_seqlens[lo]), int(b.cu_seqlens[hi])
        total = total + obj(v[t0:t1, None], part, ctx).loss
    total.backward()
    return total.detach(), v.grad


@given(data=st.data(), kind=KINDS, clip=st.sampled_from([0.05, 0.2, 10.0]), shards=st.integers(1, 3))
def test_value_loss_matches_reference(data, kind, clip, shards):
    b, v = _case(data)
    if float(b.loss_mask.sum()) == 0:
        return
    delta = 1.0
    loss, grad = _megarl(b, v, kind, clip, delta, shards)
    vp = _padded(b, v).requires_grad_(True)
    ref = value_loss(
        vp, _padded(b, b.values), _padded(b, b.returns), _padded(b, b.loss_mask), kind, clip, delta
    )
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
    cu = b.cu_seqlens.tolist()
    ref_grad = torch.cat([vp.grad[i, : cu[i + 1] - cu[i]] for i in range(len(cu) - 1)])
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


@given(data=st.data())
def test_clipped_is_at_least_mse_and_equals_it_with_a_wide_clip(data):
    b, v = _case(data)
    mse, _ = value_loss_per_token(v, b.values, b.returns, "mse")
    clipped, _ = value_loss_per_token(v, b.values, b.returns, "clipped", clip=0.1)
    assert bool((clipped >= mse).all())
    wide, was_clipped = value_loss_per_token(v, b.values, b.returns, "clipped", clip=1e9)
    assert torch.equal(wide, mse) and not bool(was_clipped.any())


@given(data=st.data(), delta=st.sampled_from([0.1, 1.0, 3.0]))
def test_huber_is_at_most_mse_and_linear_beyond_delta(data, delta):
    b, v = _case(data)
    mse, _ = value_loss_per_token(v, b.values, b.returns, "mse")
    hub, _ = value_loss_per_token(v, b.values, b.returns, "huber", huber_delta=delta)
    assert bool((hub <= mse + 1e-15).all())
    err = (v - b.returns).abs()
    inside = err <= delta
    torch.testing.assert_close(hub[inside], mse[inside])
    vv = v.clone().requires_grad_(True)
    value_loss_per_token(vv, b.values, b.returns, "huber", huber_delta=delta)[0].sum().backward()
    assert bool((vv.grad.abs() <= delta + 1e-12).all())  # the gradient is bounded by delta


@given(data=st.data(), kind=KINDS)
def test_zero_at_the_target_and_clip_freezes_far_moves(data, kind):
    b, _ = _case(data)
    at_target, _ = value_loss_per_token(b.returns.clone(), b.returns, b.returns, kind)
    assert torch.equal(at_target, torch.zeros_like(at_target))
    # V moved toward R by more than the clip: the clipped (pessimistic) branch is the larger one, and
    # the clipped value does not depend on V, so the gradient is 0
    old = b.returns + 0.5
    v = (old - 0.4).requires_grad_(True)  # |V - V_old| = 0.4 > clip = 0.1, V closer to R than V_old
    loss, clipped = value_loss_per_token(v, old, b.returns, "clipped", clip=0.1)
    loss.sum().backward()
    assert bool(clipped.all()) and torch.equal(v.grad, torch.zeros_like(v.grad))


def test_bounded_values_stay_in_range_and_start_in_the_middle():
    raw = torch.tensor([-1e4, -3.0, 0.0, 3.0, 1e4], dtype=torch.float64)
    v = bounded_values(raw, -1.0, 2.0)
    assert bool((v >= -1.0).all() and (v <= 2.0).all())
    assert float(v[2]) == 0.5
