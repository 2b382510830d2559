"""megarl's composed objective equals reference/loss.py: loss and gradient w.r.t. the logits, on
packed vs padded layouts, TP shards (simulated ranks), micro-batches and data-parallel ranks.

Tolerances. fp64: rtol 1e-9, atol 1e-10·scale. The two sides differ only in summation order and
in how log-softmax is formed (chunked max/exp/sum vs torch's fused kernel); at most a few hundred
terms of magnitude <= e^30 are summed, so the error stays near 1e-13 relative; 1e-9 leaves head-room
for exp() of ratios amplifying it. fp32: rtol 2e-4, atol 2e-5·max(1, |z|max, |value|max): fp32
epsilon is 1.2e-7, entropy/KL gradients subtract quantities of the size of the logits z, and the
same amplification applies (checked against the fp32 reference, not fp64).
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

from megarl.testing.equivalence import megarl_loss_and_grad, reference_loss_and_grad
from tests.property.strategies import rl_cases


def _assert_equivalent(case, tp, dp, mb, rtol, atol):
    ref_loss, ref_grad = reference_loss_and_grad(case)
    loss, grad = megarl_loss_and_grad(case, tp=tp, dp=dp, micro_batches=mb)
    zmax = max(1.0, float(case.logits.abs().max()))  # see the module docstring
    scale = max(zmax, float(ref_loss.abs()))
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol * scale)
    gscale = max(zmax, float(ref_grad.abs().max()) if ref_grad.numel() else 1.0)
    torch.testing.assert_close(grad, ref_grad, rtol=rtol, atol=atol * gscale)


@given(
    case=rl_cases(torch.float64),
    tp=st.sampled_from([1, 2, 4]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_objective_matches_reference_fp64(case, tp, dp, mb):
    _assert_equivalent(case, tp, dp, mb, rtol=1e-9, atol=1e-10)


@given(case=rl_cases(torch.float32), tp=st.sampled_from([1, 2]), mb=st.integers(1, 2))
def test_objective_matches_reference_fp32(case, tp, mb):
    _assert_equivalent(case, tp, 1, mb, rtol=2e-4, atol=2e-5)


@given(case=rl_cases(torch.float64, min_groups=2, min_group_size=2), tp=st.sampled_from([1, 2, 4]))
def test_one_microbatch_equals_many_in_fp64(case, tp):
    """1 micro-batch on 1 DP rank vs 2 micro-batches on each of 2 DP ranks: equal to fp64 rounding."""
    l1, g1 = megarl_loss_and_grad(case, tp=tp, dp=1, micro_batches=1)
    l4, g4 = megarl_loss_and_grad(case, tp=tp, dp=2, micro_batches=2)
    torch.testing.assert_close(l4, l1, rtol=1e-12, atol=1e-12 * max(1.0, float(l1.abs())))
    torch.testing.assert_close(g4, g1, rtol=1e-12, atol=1e-12 * max(1.0, float(g1.abs().max())))
