"""The harness bites: deliberately broken scaled code must be caught by the equivalence check.

Each mutation patches one piece of megarl (a dropped TP all-reduce, a wrong gradient on one rank,
a local instead of global normaliser) and asks hypothesis to *find* a case where megarl and the
reference disagree. If no such case is found the harness is blind to that bug and the test fails.
"""

import pytest
import torch
from hypothesis import Phase, find, settings

from megarl.ops import comm, vocab_parallel
from megarl.testing.equivalence import megarl_loss_and_grad, reference_loss_and_grad
from tests.property.strategies import rl_cases


def _disagrees(tp, dp=1, mb=1):
    def pred(case):
        ref_loss, ref_grad = reference_loss_and_grad(case)
        try:
            loss, grad = megarl_loss_and_grad(case, tp=tp, dp=dp, micro_batches=mb)
        except AssertionError:  # ranks disagree on the loss: caught too
            return True
        return not (
            torch.allclose(loss, ref_loss, rtol=1e-9, atol=1e-10)
            and torch.allclose(grad, ref_grad, rtol=1e-9, atol=1e-10)
        )

    return pred


def _drop(op_name):
    real = comm.all_reduce

    def broken(t, op, group):
        return t if op == op_name else real(t, op, group)

    return broken


@pytest.mark.parametrize("op", ["sum", "max"])
def test_dropped_tp_all_reduce_is_caught(monkeypatch, op):
    monkeypatch.setattr(comm, "all_reduce", _drop(op))
    case = find(
        rl_cases(torch.float64),
        _disagrees(tp=2),
        settings=settings(max_examples=200, database=None, phases=[Phase.generate]),
    )
    assert case.logits.shape[-1] % 2 == 0


def test_wrong_gradient_on_one_rank_is_caught(monkeypatch):
    real_backward = vocab_parallel._LogprobEntropy.backward

    def broken(ctx, g_logp, g_ent):
        grads = real_backward(ctx, g_logp, g_ent)
        if comm.rank(ctx.group) == 1:
            return (grads[0] * 1.001,) + grads[1:]
        return grads

    real_forward = vocab_parallel._LogprobEntropy.forward

    def forward(ctx, logits, targets, group, chunk, with_entropy, inplace_backward=False):
        ctx.group = group
        return real_forward(ctx, logits, targets, group, chunk, with_entropy, inplace_backward)

    monkeypatch.setattr(vocab_parallel._LogprobEntropy, "backward", staticmethod(broken))
    monkeypatch.setattr(vocab_parallel._LogprobEntropy, "forward", staticmethod(forward))
    find(
        rl_cases(torch.float64),
        _disagrees(tp=2),
        settings=settings(max_examples=200, database=None, phases=[Phase.generate]),
    )


def test_local_instead_of_global_normaliser_is_caught(monkeypatch):
    from megarl.objectives import api

    real = api.GlobalNormalisers.from_batch

    def local_only(batch, dp_group=None, max_response_len=0.0):
        return real(batch, None, max_response_len)

    monkeypatch.setattr(api.GlobalNormalisers, "from_batch", staticmethod(local_only))
    find(
        rl_cases(torch.float64, min_groups=2, min_group_size=2),
        _disagrees(tp=1, dp=2),
        settings=settings(max_examples=200, database=None, phases=[Phase.generate]),
    )
