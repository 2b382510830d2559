"""GCPO: the sharded bilateral projection and the principal-subspace overlap equal
reference/gradients.py at TP 1 and 2 (rows or columns sharded); the method's invariants on the
reference formulas. The hook inside the optimizer step of the Megatron learner is checked in
tests/learner (gradient_cases.py: gcpo:* at TP2, PP2, MoE EP2 and MoE TP2+SP)."""

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.gradients as ref
from megarl.methods.gradients.gcpo import SPEC, GcpoKnobs
from megarl.methods.gradients.subspace import MatrixBasis, project_and_overlap
from megarl.plugin.knobs import build_knobs
from megarl.testing.simulated_group import SimulatedWorld
from tests.methods.helpers import EXAMPLES


def _draw(seed: int, m: int, n: int):
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(m, n, generator=g, dtype=torch.float64)
    update = torch.randn(m, n, generator=g, dtype=torch.float64) * 1e-2
    return w0, update


@settings(max_examples=12)
@given(
    st.integers(0, 10_000),
    st.sampled_from([(4, 6), (8, 4), (6, 6)]),
    st.integers(0, 4),
    st.sampled_from([(1, None), (2, 0), (2, 1)]),
)
def test_sharded_projection_and_overlap_equal_reference(seed, shape, k, layout):
    m, n = shape
    tp, dim = layout
    w0, update = _draw(seed, m, n)
    U, V = ref.principal_bases(w0, k)

    def rank_fn(r, group):
        Ul, Vl, dW = U, V, update
        if dim == 0:
            Ul, dW = U.chunk(tp, 0)[r], update.chunk(tp, 0)[r]
        elif dim == 1:
            Vl, dW = V.chunk(tp, 0)[r], update.chunk(tp, 1)[r]
        b = MatrixBasis(Ul, Vl, dim, group if dim is not None else None, (m, n), r == 0)
        return project_and_overlap(dW, b)

    outs = SimulatedWorld(tp).run(rank_fn)
    got = torch.cat([o[0] for o in outs], dim if dim is not None else 0) if tp > 1 else outs[0][0]
    torch.testing.assert_close(got, ref.gcpo_project(update, U, V), rtol=1e-10, atol=1e-12)
    _, pso = ref.principal_overlap(update, U, V)
    for _, norm2, p in outs:
        assert abs(norm2 - float(update.pow(2).sum())) < 1e-12 and abs(p - pso) <= 1e-9 * max(1.0, pso)


@settings(max_examples=10)
@given(st.integers(0, 10_000), st.integers(1, 3))
def test_projection_is_orthogonal_idempotent_symmetric_and_kills_the_overlap(seed, k):
    w0, a = _draw(seed, 7, 5)
    b = torch.randn(7, 5, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    U, V = ref.principal_bases(w0, k)
    pa = ref.gcpo_project(a, U, V)
    assert float((U.T @ pa).abs().max()) < 1e-12 and float((pa @ V).abs().max()) < 1e-12
    torch.testing.assert_close(ref.gcpo_project(pa, U, V), pa, rtol=0, atol=1e-13)
    assert abs(float((pa * b).sum()) - float((a * ref.gcpo_project(b, U, V)).sum())) < 1e-12
    assert ref.principal_overlap(pa, U, V)[0] < 1e-24
    assert torch.equal(ref.gcpo_project(a, U[:, :0], V[:, :0]), a)  # k = 0: the plain update


def test_principal_triples_survive_projected_updates_and_random_pso_is_one():
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(9, 6, generator=g, dtype=torch.float64)
    Uf, S, Vh = torch.linalg.svd(w0, full_matrices=False)
    U, V = Uf[:, :2], Vh[:2].T
    w = w0.clone()
    for _ in range(5):
        w = w + ref.gcpo_project(torch.randn(9, 6, generator=g, dtype=torch.float64), U, V)
    for j in range(2):
        torch.testing.assert_close(w @ Vh[j], S[j] * Uf[:, j], rtol=0, atol=1e-12)
        torch.testing.assert_close(Uf[:, j] @ w, S[j] * Vh[j], rtol=0, atol=1e-12)
    big = torch.randn(64, 48, generator=g, dtype=torch.float64)
    Ub, Vb = ref.principal_bases(big, 4)
    psos = [
        ref.principal_overlap(torch.randn(64, 48, generator=g, dtype=torch.float64), Ub, Vb)[1]
        for _ in range(300)
    ]
    mean = sum(psos) / len(psos)
    assert abs(mean - 1.0) < 0.1, mean


def test_knobs_are_checked_and_the_example_names_the_method():
    with pytest.raises(ValueError, match="method: rank"):
        build_knobs(GcpoKnobs, {"rank": -1}, "method")
    cfg = yaml.safe_load((EXAMPLES / "gcpo.yaml").read_text())
    assert cfg["method"]["name"] == SPEC.name and cfg["base"] == "../quickstart.yaml"
    build_knobs(GcpoKnobs, {k: v for k, v in cfg["method"].items() if k != "name"}, "method")
