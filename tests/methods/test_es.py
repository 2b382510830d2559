"""ES: on a quadratic the estimator's mean approaches the gradient, antithetic pairs are unbiased with
lower variance, the update from seeds and scalar rewards equals reference/perturbation.py bit for
bit, the hook pushes every member and restores θ exactly, and GRPO -> ES switches at start_step."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.perturbation as rp
from megarl.convert.plan import Entry
from megarl.methods.gradients.es import ESKnobs, ESUpdate, member_seeds, members, update_coefficients
from megarl.methods.gradients.noise import gaussian, tensor_key
from megarl.methods.gradients.perturbation import WeightPerturbation, param_noise_map
from megarl.plugin.knobs import build_knobs
from tests.methods.helpers import load_example

D = 6
THETA = torch.tensor([0.5, -1.0, 0.25, 2.0, 0.0, -0.5], dtype=torch.float64)
STAR = torch.zeros(D, dtype=torch.float64)


def J(theta: torch.Tensor) -> float:
    """The quadratic toy objective −‖θ − θ*‖² (its Gaussian smoothing has the same gradient)."""
    return -float(((theta - STAR) ** 2).sum())


_EPS: dict[int, torch.Tensor] = {}


def eps(seed: int) -> torch.Tensor:
    return _EPS[seed]


def fill_eps(seeds: list[int]) -> None:
    """ε(seed) of many seeds in one vectorised call (the generator's keys broadcast per row)."""
    if not seeds:
        return
    keys = torch.tensor([tensor_key(s, "theta") for s in seeds], dtype=torch.int64)
    z = gaussian(keys[:, :1], keys[:, 1:], torch.arange(D).expand(len(seeds), D)).double()
    _EPS.update(zip(seeds, z))


def estimate(step: int, n: int, sigma: float, antithetic: bool, mode: str = "none") -> torch.Tensor:
    """ĝ of one population through megarl's member seeds and update coefficients (lr = 1)."""
    mem = members(member_seeds(0, step, n), antithetic)
    fill_eps([s for s, _ in mem if s not in _EPS])
    r = torch.tensor([J(THETA + sign * sigma * eps(s)) for s, sign in mem], dtype=torch.float64)
    seeds, coeffs = update_coefficients(mem, r, sigma, 1.0, mode)
    return sum(c * eps(s) for s, c in zip(seeds, coeffs))


def test_estimator_mean_approaches_the_gradient_and_antithetic_is_unbiased_with_lower_variance():
    grad = -2 * (THETA - STAR)
    K, sigma = 200, 0.1
    fill_eps(
        [s for k in range(K) for s in member_seeds(0, k, 4)]
        + [s for k in range(K) for s in member_seeds(0, 10_000 + k, 8) + member_seeds(0, 20_000 + k, 8)]
    )
    anti = torch.stack([estimate(k, 4, sigma, True) for k in range(K)])  # 8 evaluations each
    plain = torch.stack([estimate(10_000 + k, 8, sigma, False) for k in range(K)])  # 8 evaluations each
    for g in (anti, plain):
        se = g.std(0) / K**0.5
        assert bool(((g.mean(0) - grad).abs() <= 4 * se + 1e-9).all()), (g.mean(0), grad, se)
    assert float(anti.var(0).sum()) < 0.05 * float(plain.var(0).sum())  # J(θ) and σ² terms cancel in pairs
    zs = torch.stack([estimate(20_000 + k, 8, sigma, True, "zscore") for k in range(K)]).mean(0)
    assert float(torch.nn.functional.cosine_similarity(zs, grad, dim=0)) > 0.95  # z-scored: same direction


@settings(max_examples=15)
@given(
    st.lists(st.floats(-2, 2, allow_nan=False), min_size=4, max_size=4),
    st.sampled_from(["zscore", "center", "none"]),
    st.booleans(),
)
def test_update_from_seeds_and_rewards_equals_the_reference(rewards, mode, antithetic):
    seeds = [3, 5] if antithetic else [3, 5, 7, 11]
    mem = members(seeds, antithetic)
    r = torch.tensor(rewards, dtype=torch.float64)
    w = torch.randn(3, 5)
    pert = _perturbation(w.clone())
    pert.add_noise_sum(*update_coefficients(mem, r, 0.02, 0.1, mode))
    want = rp.es_update({"w": w}, [s for s, _ in mem], [g for _, g in mem], r, 0.02, 0.1, mode)["w"]
    assert torch.equal(pert.maps[0].param.data, want)


def _perturbation(w: torch.Tensor) -> WeightPerturbation:
    p = torch.nn.Parameter(w, requires_grad=False)
    return WeightPerturbation([param_noise_map(Entry("w", ("w",), "replicated", 0), p, None, 1, 0)])


def test_hook_climbs_a_quadratic_pushing_every_member_and_restoring_theta():
    theta0 = torch.tensor([0.5, -1.0, 0.25, 2.0], dtype=torch.float32)
    pert = _perturbation(theta0.clone())
    w = pert.maps[0].param
    pushed: list[tuple[str, torch.Tensor]] = []
    ctx = SimpleNamespace(rank0=True, push_weights=lambda label: pushed.append((label, w.data.clone())))
    knobs = ESKnobs(population=4, sigma=0.05, lr=0.05, antithetic=True, normalise="zscore", start_step=3)
    hook = ESUpdate(
        ctx, knobs, None, perturbation=pert, score=lambda step, m: -float((pushed[-1][1] ** 2).sum())
    )

    assert hook.updates_policy(1) and hook.updates_policy(2) and not hook.updates_policy(3)  # GRPO -> ES
    assert hook.after_step(2, {}) == {"es/active": 0.0} and not pushed and torch.equal(w.data, theta0)

    before = w.data.clone()
    m = hook.after_step(3, {})
    mem = members(member_seeds(0, 3, 4), True)
    assert [lbl for lbl, _ in pushed] == ["es-member"] * 8
    for (s, sign), (_, p) in zip(mem, pushed):  # member m saw θ + s σ ε(seed), from the same θ
        assert torch.equal(p, rp.perturb_state({"w": before}, s, sign * 0.05)["w"])
    r = torch.tensor([-float((p**2).sum()) for _, p in pushed], dtype=torch.float64)
    want = rp.es_update({"w": before}, [s for s, _ in mem], [g for _, g in mem], r, 0.05, 0.05, "zscore")
    assert torch.equal(w.data, want["w"])  # restored exactly, then the update from seeds and rewards
    assert m["es/members"] == 8.0 and m["es/active"] == 1.0

    for step in range(4, 14):
        hook.after_step(step, {})
    assert float((w.data**2).sum()) < 0.5 * float((theta0**2).sum())
    assert hook.state_dict() == {"updates": 11}


def test_knobs_are_checked_and_the_example_loads():
    for bad in ({"population": 0}, {"sigma": 0.0}, {"normalise": "rank"}, {"start_step": 0}):
        with pytest.raises(ValueError, match="method"):
            build_knobs(ESKnobs, bad, "method")
    cfg = load_example("es")
    assert cfg["method"]["name"] == "es" and cfg["method"]["antithetic"] is True
