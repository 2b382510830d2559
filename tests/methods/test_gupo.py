"""GUPO: the weights equal reference/gradients.py and keep the method's invariants; the hook's
per-token sketch arithmetic equals the Kronecker projection of exact per-sequence gradients; the
weighted-advantage loss equals the explicit weighted sum of per-group losses in loss and gradient
(TP 1/2, DP 1/2, 1-2 micro-batches). The hooked pass on the Megatron model is checked against
exact per-sequence gradients in tests/learner (gradient_cases.py: gupo:* at TP1/DP2, TP2, TP2+SP,
PP2, MoE EP2)."""

import dataclasses

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.gradients as ref
from megarl.methods.gradients.gupo import EVIDENCE_KINDS, SPEC, GupoKnobs, gupo_weights, scale_advantages
from megarl.methods.gradients.sketch import seeded_gaussian, token_sketches
from megarl.objectives.objective_config import ObjectiveConfig
from megarl.plugin.knobs import build_knobs
from megarl.testing.equivalence import megarl_loss_and_grad, reference_loss_and_grad
from tests.methods.helpers import EXAMPLES
from tests.property.strategies import rl_cases


@st.composite
def sketch_sets(draw):
    """Per-rollout vectors [B, d] (some zero: groups with equal rewards) and group ids."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    gids = torch.repeat_interleave(torch.arange(len(sizes)) * 3, torch.tensor(sizes))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    v = torch.randn(len(gids), draw(st.sampled_from([3, 16])), generator=g, dtype=torch.float64)
    shared = torch.randn(v.shape[1], generator=g, dtype=torch.float64)
    v = v + draw(st.sampled_from([0.0, 2.0])) * shared  # a common direction (agreement) or none
    zero = draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    for q, z in enumerate(zero):
        if z:
            v[gids == q * 3] = 0.0
    return v, gids


def _dense(gids):
    return torch.unique(gids, return_inverse=True)[1]


@settings(max_examples=15)
@given(sketch_sets(), st.sampled_from(EVIDENCE_KINDS), st.floats(0.01, 100.0))
def test_weights_equal_reference_nonnegative_mean_one_and_scale_free(data, evidence, scale):
    v, gids = data
    w, unc = gupo_weights(v, _dense(gids), evidence)
    w_ref, unc_ref = ref.gupo_weights(v, gids, evidence)
    torch.testing.assert_close(w, w_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(unc, unc_ref, rtol=1e-10, atol=1e-12)
    assert bool((w >= 0).all()) and abs(float(w.mean()) - 1.0) < 1e-9
    assert bool((unc > 0).all()) and bool((unc <= 1).all())
    torch.testing.assert_close(gupo_weights(v * scale, _dense(gids), evidence)[0], w, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("evidence", EVIDENCE_KINDS)
def test_identical_groups_give_grpo_and_anti_aligned_group_gets_the_least(evidence):
    g = torch.Generator().manual_seed(0)
    one = torch.randn(3, 8, generator=g, dtype=torch.float64) + 3 * torch.ones(8, dtype=torch.float64)
    v = one.repeat(4, 1)
    gids = torch.arange(4).repeat_interleave(3)
    assert torch.equal(gupo_weights(v, gids, evidence)[0], torch.ones(4, dtype=torch.float64))
    v[9:] = -v[9:]  # group 3 points against the others
    w, _ = gupo_weights(v, gids, evidence)
    assert float(w[3]) == float(w.min()) < float(w[:3].min())


def test_uncertainty_falls_with_each_agreeing_rollout():
    base = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    other = torch.tensor([[1.0, 0.2, 0.0], [-1.0, 0.3, 0.0]], dtype=torch.float64)
    last = None
    for n in range(1, 5):
        v = torch.cat([other, base.repeat(n, 1)])
        gids = torch.tensor([0, 0] + [1] * n)
        unc = gupo_weights(v, gids, "rollout_agreement")[1][1]
        assert 0 < float(unc) <= 1 and (last is None or float(unc) < last)
        last = float(unc)


@settings(max_examples=10)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.integers(0, 1000), st.sampled_from([2, 5]))
def test_token_sketches_equal_projection_of_exact_sequence_gradients(lens, seed, r):
    """A linear layer on packed tokens, one loss per sequence: the per-token outer products of the
    hook equal A G_s Bᵀ of each sequence's exact gradient G_s (one backward each)."""
    g = torch.Generator().manual_seed(seed)
    m, n, T = 6, 4, sum(lens)
    W = torch.randn(m, n, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(T, n, generator=g, dtype=torch.float64)
    target = torch.randn(T, m, generator=g, dtype=torch.float64)
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    y = x @ W.T
    losses = [((y[seq == s] - target[seq == s]) ** 3).sum() for s in range(len(lens))]
    A, B = seeded_gaussian(r, m, seed, "A"), seeded_gaussian(r, n, seed, "B")
    want = torch.stack(
        [ref.kronecker_sketch(G.reshape(m, n), A, B).reshape(-1) for G in ref.exact_gradients(losses, [W])]
    )
    d = torch.autograd.grad(sum(losses), y)[0]  # the gradient at the layer's output, one backward
    torch.testing.assert_close(token_sketches(d @ A.T, x @ B.T, seq, len(lens)), want, rtol=1e-10, atol=1e-10)


def test_seeded_projection_is_unbiased_for_inner_products():
    """E <A G Bᵀ, A H Bᵀ> = <G, H> (averaged over 400 seeds, within 4 standard errors)."""
    g = torch.Generator().manual_seed(1)
    G, H = torch.randn(2, 12, 10, generator=g, dtype=torch.float64)
    H = H + G
    vals = torch.tensor(
        [
            float((ref.kronecker_sketch(G, A, B) * ref.kronecker_sketch(H, A, B)).sum())
            for A, B in ((seeded_gaussian(4, 12, s, "A"), seeded_gaussian(4, 10, s, "B")) for s in range(400))
        ]
    )
    assert abs(float(vals.mean()) - float((G * H).sum())) < 4 * float(vals.std()) / 20


CFGS = st.builds(
    ObjectiveConfig,
    policy_loss=st.sampled_from(["ppo", "cispo"]),
    aggregation=st.sampled_from(["token-mean", "seq-mean-token-mean"]),
)


@settings(max_examples=6)
@given(case=rl_cases(torch.float64, cfgs=CFGS, min_groups=2), data=st.data())
def test_weighted_advantages_equal_weighted_group_losses(case, data):
    """Loss and logits gradient of the run's objective on GUPO-scaled advantages equal
    sum_q w_q L_q (reference loss of each group alone), sharded, micro-batched and DP-split."""
    b = case.batch
    group_of = _dense(b.group_ids)
    Q = int(group_of.max()) + 1
    w = torch.tensor(data.draw(st.lists(st.floats(0, 3), min_size=Q, max_size=Q)), dtype=torch.float64)
    tp, dp, mb = data.draw(st.sampled_from([(1, 1, 1), (2, 1, 2), (2, 2, 1), (1, 2, 2)]))
    scaled = dataclasses.replace(
        case, batch=dataclasses.replace(b, advantages=scale_advantages(b, w, group_of))
    )
    loss, grad = megarl_loss_and_grad(scaled, tp=tp, dp=min(dp, b.num_seqs), micro_batches=mb)
    want_loss, want_grad = 0.0, torch.zeros_like(case.logits)
    mask_of = torch.repeat_interleave(group_of, b.seq_lens)
    for q in range(Q):  # group q alone: the other groups' advantages zeroed (same normalisers)
        only = dataclasses.replace(b, advantages=b.advantages * (mask_of == q).to(b.advantages))
        lq, gq = reference_loss_and_grad(dataclasses.replace(case, batch=only))
        want_loss, want_grad = want_loss + float(w[q]) * lq, want_grad + float(w[q]) * gq
    torch.testing.assert_close(loss, torch.as_tensor(want_loss, dtype=loss.dtype), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-10)


def test_knobs_are_checked_and_the_example_names_the_method():
    with pytest.raises(ValueError, match="method: evidence"):
        build_knobs(GupoKnobs, {"evidence": "votes"}, "method")
    with pytest.raises(ValueError, match="method: sketch_rank"):
        build_knobs(GupoKnobs, {"sketch_rank": 0}, "method")
    cfg = yaml.safe_load((EXAMPLES / "gupo.yaml").read_text())
    assert cfg["method"]["name"] == SPEC.name and cfg["base"] == "../quickstart.yaml"
    build_knobs(GupoKnobs, {k: v for k, v in cfg["method"].items() if k != "name"}, "method")
