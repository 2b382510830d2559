"""GeoSD: megarl's regulariser (TP 1/2, DP 1/2, micro-batched) equals reference/distillation.py:
geosd_loss in loss and gradient; the geometric invariants (H² and d_FR ranges, symmetry, triangle
inequality, the Hellinger pull fading where the student has no mass, zero proximal term and
gradient at the checkpoint); the lagged copy holds its weights between refreshes."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.distillation as rd
from megarl.batch import from_sequences, unpack
from megarl.methods.distillation.geosd import (
    CHECKPOINT,
    CheckpointPass,
    fisher_rao_sq,
    natural_logit_grad,
)
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective
from megarl.ops import comm
from megarl.testing.equivalence import megarl_loss_and_grad
from tests.methods.trust_regions_harness import aggregate, assert_equivalent, reference_method_loss_and_grad
from tests.property.strategies import rl_cases

CFGS = st.builds(
    lambda agg, beta, coef: ObjectiveConfig(
        policy_loss="none", aggregation=agg, regularisers=[{"name": "geosd", "coef": coef, "beta": beta}]
    ),
    st.sampled_from(("token-mean", "seq-mean-token-mean")),
    st.sampled_from([0.0, 0.1, 1.0]),
    st.sampled_from([1.0, 0.5]),
)


def _padded(b, x: torch.Tensor) -> torch.Tensor:
    am = unpack(b).attention_mask
    out = torch.zeros(am.shape + x.shape[1:], dtype=x.dtype)
    out[am] = x
    return out


class _Sharded:
    """The objective with this TP rank's vocab shard of the checkpoint's logits (as the checkpoint
    pass leaves them on each rank; the harness shards the teacher's logits itself)."""

    def __init__(self, cfg, tp: int):
        self.obj, self.tp = build_objective(cfg), tp

    def __call__(self, logits, batch, ctx):
        r = comm.rank(ctx.tp_group)
        ex = {k: v.chunk(self.tp, -1)[r] for k, v in batch.token_extras.items()}
        return self.obj(logits, dataclasses.replace(batch, token_extras=ex), ctx)


@settings(max_examples=6)
@given(
    case=rl_cases(torch.float64, cfgs=CFGS, vocab_sizes=(4, 8, 12)),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_matches_reference(case, tp, dp, mb):
    b = case.batch
    g = torch.Generator().manual_seed(b.num_tokens)
    ck = case.logits + 0.5 * torch.randn(case.logits.shape, generator=g, dtype=torch.float64)
    b.token_extras = {CHECKPOINT: ck}  # the self-teacher's logits: case.teacher_logits
    reg = case.cfg.regularisers[0]
    mb = min(mb, -(-b.num_seqs // dp))

    def fn(full, pad):
        per_token = rd.geosd_loss(full, _padded(b, case.teacher_logits), _padded(b, ck), reg["beta"])
        return reg["coef"] * aggregate(per_token, pad, case.cfg.aggregation)

    got = megarl_loss_and_grad(case, tp, dp, mb, objective=_Sharded(case.cfg, tp))
    assert_equivalent(got, reference_method_loss_and_grad(case, fn), case.logits)


NAT_CFGS = st.builds(
    lambda agg, beta, damping: ObjectiveConfig(
        policy_loss="none",
        aggregation=agg,
        regularisers=[{"name": "geosd_natural", "coef": 1.0, "beta": beta, "damping": damping}],
    ),
    st.sampled_from(("token-mean", "seq-mean-token-mean")),
    st.sampled_from([0.0, 0.5]),
    st.sampled_from([1e-3, 0.1]),
)


@settings(max_examples=4, deadline=None)
@given(
    case=rl_cases(torch.float64, cfgs=NAT_CFGS, vocab_sizes=(4, 8, 12)),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
)
def test_natural_gradient_matches_reference(case, tp, dp, mb):
    """geosd_natural: the GeoSD value, and the logits gradient (F + λI)^{-1} g per token (Sherman-
    Morrison over the vocab shards) equal to the reference's dense solve."""
    b = case.batch
    g = torch.Generator().manual_seed(b.num_tokens)
    ck = case.logits + 0.5 * torch.randn(case.logits.shape, generator=g, dtype=torch.float64)
    b.token_extras = {CHECKPOINT: ck}
    reg = case.cfg.regularisers[0]
    mb = min(mb, -(-b.num_seqs // dp))

    def fn(full, pad):
        t, c = _padded(b, case.teacher_logits), _padded(b, ck)
        per_token = rd.geosd_natural_loss(full, t, c, reg["beta"], reg["damping"])
        return aggregate(per_token, pad, case.cfg.aggregation)

    got = megarl_loss_and_grad(case, tp, dp, mb, objective=_Sharded(case.cfg, tp))
    assert_equivalent(got, reference_method_loss_and_grad(case, fn), case.logits)


def test_natural_gradient_solves_the_damped_fisher_system():
    """F ĝ + λ ĝ = g with g the autograd gradient of the GeoSD loss (analytic g checked too); ĝ is
    q-orthogonal up to λ (Σ q ĝ = Σ g / (1 − Σq²/(q+λ)) · ... = 0 when λ → 0) and, at the
    checkpoint with β only, 0."""
    g0 = torch.Generator().manual_seed(1)
    z, t, c = (torch.randn(5, 9, generator=g0, dtype=torch.float64) * 2 for _ in range(3))
    for beta, lam in ((0.0, 1e-3), (0.7, 1e-2), (1.0, 1.0)):
        nat = natural_logit_grad(z, t, c, beta, lam)
        zz = z.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(rd.geosd_loss(zz, t, c, beta).sum(), zz)
        q = torch.softmax(z, -1)
        fisher = torch.diag_embed(q) - q.unsqueeze(-1) * q.unsqueeze(-2)
        lhs = (fisher @ nat.unsqueeze(-1)).squeeze(-1) + lam * nat
        assert torch.allclose(lhs, grad, atol=1e-10), (beta, lam)
    assert float(natural_logit_grad(z, z, z, 1.0, 1e-3).abs().max()) < 1e-6  # teacher = student = ck


def test_geometry():
    g = torch.Generator().manual_seed(0)
    p, q, r = (torch.randn(200, 7, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    h2 = rd.hellinger_sq(p, q)
    assert bool(((h2 >= 0) & (h2 <= 1)).all()) and torch.allclose(
        rd.hellinger_sq(p, p), torch.zeros(200, dtype=torch.float64)
    )

    def d(x, y):
        return fisher_rao_sq(rd.bhattacharyya(x, y)).sqrt()

    assert bool(((d(p, q) >= 0) & (d(p, q) <= torch.pi)).all()) and torch.allclose(d(p, q), d(q, p))
    assert bool((d(p, r) <= d(p, q) + d(q, r) + 1e-9).all())  # triangle inequality
    assert float(rd.fisher_rao_sq(q, q).abs().max()) < 1e-12  # 0 at the checkpoint (rounding of BC)
    z = q.clone().requires_grad_(True)
    (gz,) = torch.autograd.grad(rd.fisher_rao_sq(z, q).sum(), z)
    assert float(gz.abs().max()) < 1e-6  # and (nearly) no pull there


def test_hellinger_pull_fades_where_the_student_has_no_mass():
    """Teacher token u with q(u) -> 0: ∂H²/∂z_u -> 0, while forward KL's pull stays -p(u)."""
    teacher = torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64)  # uniform: p(u) = 1/3
    for gap, bound in ((10.0, 1e-2), (30.0, 1e-6)):
        z = torch.tensor([0.0, 0.0, -gap], dtype=torch.float64, requires_grad=True)
        (gh,) = torch.autograd.grad(rd.hellinger_sq(teacher, z), z)
        (gk,) = torch.autograd.grad(rd.forward_kl(z, teacher), z)
        assert abs(float(gh[2])) < bound and abs(float(gk[2]) + 1 / 3) < 1e-3


def _tiny_policy(seed: int = 3):
    from megarl.learner.factory import build_learner
    from megarl.learner.optim_config import OptimConfig
    from tests.methods.teacher_cases import tiny_learner_setup

    hf, groups = tiny_learner_setup(24)
    return build_learner(hf, groups, OptimConfig(), seed=seed, trainable=False), hf, groups


def test_the_lagged_copy_holds_its_weights_between_refreshes():
    from megarl.learner.factory import build_learner
    from megarl.learner.optim_config import OptimConfig

    policy, hf, groups = _tiny_policy()
    b = from_sequences([[1, 5, 6], [1, 7]], [[8, 9, 10], [11, 12, 13, 14]], [0, 1])
    own = policy.compute_logits(b, 1)
    copy = build_learner(hf, groups, OptimConfig(), seed=9, trainable=False)
    p = CheckpointPass(copy, policy, refresh_every=2)
    assert p.fill(b, 1) == {"geosd/checkpoint_age": 0.0}  # step 1: refreshed to the policy
    torch.testing.assert_close(b.token_extras[CHECKPOINT], own, rtol=0, atol=0)
    with torch.no_grad():
        for w in policy.model.parameters():
            w.add_(0.05)
    assert p.fill(b, 1) == {"geosd/checkpoint_age": 1.0}  # step 2: still the old weights
    torch.testing.assert_close(b.token_extras[CHECKPOINT], own, rtol=0, atol=0)
    p.fill(b, 1)  # step 3: refreshed
    torch.testing.assert_close(b.token_extras[CHECKPOINT], policy.compute_logits(b, 1), rtol=0, atol=0)
    assert not torch.equal(b.token_extras[CHECKPOINT], own)


def test_missing_inputs_are_named():
    import pytest

    from megarl.objectives.api import GlobalNormalisers, LossContext

    b = from_sequences([[1]], [[2, 3]], [0])
    obj = build_objective({"policy_loss": "none", "regularisers": [{"name": "geosd", "coef": 1.0}]})
    with pytest.raises(ValueError, match="self_teacher_logits"):
        obj(torch.zeros(3, 4), b, LossContext(GlobalNormalisers(2, 1)))


def test_a_sequence_the_self_teacher_did_not_read_is_refused():
    """Unread sequences carry zero logits (a uniform teacher): GeoSD refuses them, naming the knob."""
    import pytest

    from megarl.objectives.api import GlobalNormalisers, LossContext

    b = from_sequences([[1], [1]], [[2, 3], [3]], [0, 0])
    b.token_extras["checkpoint_logits"] = torch.zeros(b.num_tokens, 4)
    b.extras["self_teacher_on"] = torch.tensor([1.0, 0.0], dtype=torch.float64)
    obj = build_objective({"policy_loss": "none", "regularisers": [{"name": "geosd", "coef": 1.0}]})
    ctx = LossContext(GlobalNormalisers(3, 2), teacher_logits=torch.zeros(b.num_tokens, 4))
    with pytest.raises(ValueError, match=r"read 1 of 2 sequences.*when: all"):
        obj(torch.zeros(b.num_tokens, 4), b, ctx)
    b.extras["self_teacher_on"] = torch.ones(2, dtype=torch.float64)
    assert torch.isfinite(obj(torch.zeros(b.num_tokens, 4), b, ctx).loss)
