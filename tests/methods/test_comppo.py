"""CompPO / Comp-GAE: the gated reverse scan equals reference/critics.py's closed-form sum; PPO on
Comp-GAE advantages equals the reference in loss and gradient under TP, DP and micro-batch splits;
the TAC head's value loss equals the reference in loss and gradient; and the spec's invariants
(g ≡ 1 is GAE, g ≡ c is GAE with γc, the gate stays in [g_min, g_max], no gradient reaches the
attention, shuffling the gates changes the advantages)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.critics as rc
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import gae, token_rewards
from megarl.batch import unpack
from megarl.methods.critics.comp_gae import (
    CONCENTRATION,
    ConcentrationKnobs,
    comp_gate,
    concentration_from_sums,
    gated_gae,
)
from megarl.methods.critics.trunk import TrunkHead, aligned_values
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.objectives.value_losses import ValueObjective
from megarl.plugin.knobs import build_knobs
from megarl.testing.equivalence import megarl_loss_and_grad, reference_loss_and_grad
from tests.property.strategies import rl_cases
from tests.property.test_advantages import reward_batches

COMP = ADVANTAGE_ESTIMATORS.get("comp_gae")
KNOBS = st.fixed_dictionaries(
    {
        "g_min": st.sampled_from([0.0, 0.5, 0.9]),
        "g_max": st.sampled_from([0.95, 1.0]),
        "slope": st.sampled_from([0.5, 1.0, 3.0]),
        "offset": st.sampled_from([-1.0, 0.0, 2.0]),
        "gamma": st.sampled_from([1.0, 0.9]),
        "lam": st.sampled_from([1.0, 0.95, 0.5]),
    }
)


def _padded(b, x):
    am = unpack(b).attention_mask
    out = torch.zeros(am.shape, dtype=torch.float64)
    out[am] = x.double()
    return out


def _reference(b, kappa, k):
    """reference gate and Comp-GAE on the padded batch -> (advantages [T], returns [T])."""
    pad = unpack(b)
    am, m = pad.attention_mask, pad.loss_mask.double()
    gate = rc.comp_gate(_padded(b, kappa), m, k["g_min"], k["g_max"], k["slope"], k["offset"])
    adv, ret = rc.comp_gae(_padded(b, token_rewards(b)), _padded(b, b.values), gate, m, k["gamma"], k["lam"])
    return adv[am], ret[am]


def _with_kappa(b, seed):
    g = torch.Generator().manual_seed(seed)
    b.token_extras[CONCENTRATION] = torch.rand(b.num_tokens, generator=g, dtype=torch.float64)
    return b.token_extras[CONCENTRATION]


@settings(max_examples=15, deadline=None)
@given(reward_batches(), KNOBS, st.integers(0, 2**31 - 1), st.booleans())
def test_reverse_scan_equals_the_reference_closed_form(b, k, seed, outcome_only):
    if outcome_only:
        b.token_rewards = None
    kappa = _with_kappa(b, seed)
    adv = COMP(b, **k)
    want_adv, want_ret = _reference(b, kappa, k)
    torch.testing.assert_close(adv, want_adv, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(b.returns.double(), want_ret, rtol=1e-10, atol=1e-10)


@settings(max_examples=10, deadline=None)
@given(reward_batches(), st.sampled_from([1.0, 0.9]), st.sampled_from([0.95, 0.5]), st.floats(0.3, 1.0))
def test_constant_gate_is_gae_with_gamma_times_c(b, gamma, lam, c):
    """g ≡ 1 gives GAE(γ, λ) exactly; g ≡ c gives GAE with γ' = γc in bootstrap and trace."""
    m, r, v = b.loss_mask.double(), token_rewards(b), b.values.double()
    ones = torch.ones_like(m)
    got, got_ret = gated_gae(r, v, ones, m, b.cu_seqlens, gamma, lam)
    want, want_ret = gae(r, v, m, b.cu_seqlens, gamma, lam)
    assert torch.equal(got, want) and torch.equal(got_ret, want_ret)
    got_c, _ = gated_gae(r, v, c * ones, m, b.cu_seqlens, gamma, lam)
    want_c, _ = gae(r, v, m, b.cu_seqlens, gamma * c, lam)
    torch.testing.assert_close(got_c, want_c, rtol=1e-12, atol=1e-12)
    # through the estimator: equal concentrations standardise to 0, and g_min = g_max = 1 is GAE
    b.token_extras[CONCENTRATION] = torch.full_like(m, 0.3)
    est = COMP(b, gamma=gamma, lam=lam, g_min=1.0, g_max=1.0)
    assert torch.equal(est, want)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=40),
    st.floats(0.0, 0.5),
    st.floats(0.5, 1.0),
    st.floats(-10, 10),
    st.floats(-10, 10),
)
def test_gate_stays_in_its_bounds(kappa, g_min, g_max, slope, offset):
    k = torch.tensor(kappa, dtype=torch.float64)
    g = comp_gate(k, torch.ones_like(k), g_min, g_max, slope, offset)
    assert bool((g >= g_min).all()) and bool((g <= g_max).all())
    torch.testing.assert_close(g, rc.comp_gate(k, torch.ones_like(k), g_min, g_max, slope, offset))


def test_no_gradient_reaches_the_attention():
    """The concentration and the gate are detached: a κ that requires grad gives a gate that does
    not, and advantages through it give no gradient back to κ."""
    sums = torch.rand(7, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 3, 7])
    kappa = concentration_from_sums(sums, 4, cu, "entropy")
    gate = comp_gate(kappa, torch.ones(7, dtype=torch.float64))
    assert not gate.requires_grad
    v = torch.rand(7, dtype=torch.float64, requires_grad=True)
    adv, _ = gated_gae(torch.rand(7, dtype=torch.float64), v, gate, torch.ones(7), cu)
    adv.sum().backward()
    assert sums.grad is None and v.grad is not None


def test_shuffling_the_gates_changes_the_advantages():
    """The ablation hook: the same gate values in another order give other advantages."""
    g = torch.Generator().manual_seed(3)
    from megarl.batch import from_sequences

    b = from_sequences([[1, 2]] * 2, [list(range(3, 13)), list(range(3, 11))], [0, 1])
    b.rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    b.values = torch.rand(b.num_tokens, generator=g, dtype=torch.float64)
    b.token_extras[CONCENTRATION] = torch.rand(b.num_tokens, generator=g, dtype=torch.float64)
    k = {"g_min": 0.5, "slope": 3.0, "lam": 0.9}
    plain = COMP(b, **k)
    shuffled = COMP(b, shuffle=True, shuffle_seed=1, **k)
    assert float((plain - shuffled).abs().max()) > 1e-3
    again = COMP(b, shuffle=True, shuffle_seed=1, **k)
    assert torch.equal(shuffled, again)  # seeded: every rank draws the same permutation


def test_concentration_of_attention_rows_matches_the_reference():
    """κ from per-position entropy sums (the learner's hook output) equals the reference's κ of the
    attention rows, aligned so token t gets the query at t − 1."""
    g = torch.Generator().manual_seed(0)
    lens = [4, 6]
    cu = torch.tensor([0, 4, 10])
    heads = 3
    sums_e = torch.zeros(10, dtype=torch.float64)
    sums_m = torch.zeros(10, dtype=torch.float64)
    want_e, want_m = [], []
    for i, L in enumerate(lens):
        logits = torch.randn(heads, L, L, generator=g, dtype=torch.float64)
        logits = logits.masked_fill(torch.ones(L, L).triu(1).bool(), float("-inf"))
        probs = torch.softmax(logits, -1)
        ent = -(probs * torch.log(probs.clamp(min=1e-300))).sum(-1).sum(0)
        sums_e[int(cu[i]) : int(cu[i + 1])] = ent
        sums_m[int(cu[i]) : int(cu[i + 1])] = probs.amax(-1).sum(0)
        want_e.append(rc.attention_concentration(probs, "entropy"))
        want_m.append(rc.attention_concentration(probs, "max"))
    for sums, want, stat in ((sums_e, want_e, "entropy"), (sums_m, want_m, "max")):
        got = concentration_from_sums(sums, heads, cu, stat)
        for i in range(2):
            seg = got[int(cu[i]) : int(cu[i + 1])]
            assert float(seg[0]) == 0.0
            torch.testing.assert_close(seg[1:], want[i][:-1], rtol=1e-12, atol=1e-12)
    assert bool((want_e[0] >= -1e-12).all() and (want_e[0] <= 1 + 1e-12).all())


@settings(max_examples=12, deadline=None)
@given(
    rl_cases(torch.float64, cfgs=st.just(ObjectiveConfig(policy_loss="ppo", aggregation="token-mean"))),
    KNOBS,
    st.integers(0, 2**31 - 1),
    st.sampled_from([(1, 1, 1), (2, 2, 2), (1, 2, 3), (2, 1, 2)]),
)
def test_ppo_on_comp_gae_matches_reference_loss_and_gradient(case, k, seed, split):
    b = case.batch
    g = torch.Generator().manual_seed(seed)
    b.token_rewards = None
    b.values = torch.randn(b.num_tokens, generator=g, dtype=torch.float64)
    kappa = _with_kappa(b, seed)
    b.advantages = COMP(b, **k) * b.loss_mask
    want_adv, _ = _reference(b, kappa, k)
    tp, dp, mb = split
    loss, grad = megarl_loss_and_grad(case, tp=tp, dp=dp, micro_batches=mb)
    ref_case = dataclasses.replace(case, batch=dataclasses.replace(b, advantages=want_adv * b.loss_mask))
    ref_loss, ref_grad = reference_loss_and_grad(ref_case)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-10)


@settings(max_examples=10, deadline=None)
@given(reward_batches(), st.sampled_from(["mse", "clipped", "huber"]), st.integers(0, 2**31 - 1))
def test_tac_head_value_loss_matches_reference(b, kind, seed):
    """The TAC head's values are head(h_{t−1}); its loss toward the Comp-GAE returns equals
    reference value_loss in loss and in gradient with respect to the hidden states."""
    g = torch.Generator().manual_seed(seed)
    b.token_extras[CONCENTRATION] = torch.rand(b.num_tokens, generator=g, dtype=torch.float64)
    COMP(b)
    head = TrunkHead(6, 5, seed).double()
    with torch.no_grad():
        head.out.weight.normal_(generator=g)
    h1 = torch.randn(b.num_tokens, 6, generator=g, dtype=torch.float64).requires_grad_(True)
    h2 = h1.detach().clone().requires_grad_(True)
    v = aligned_values(head, h1, b.cu_seqlens)
    ctx = LossContext(normalisers=GlobalNormalisers.from_batch(b))
    got = ValueObjective(kind, 0.2)(v[:, None], b, ctx).loss
    got.backward()
    pad = unpack(b)
    want = rc.value_loss(
        _padded_grad(b, aligned_values(head, h2, b.cu_seqlens)),
        _padded(b, b.values),
        _padded(b, b.returns),
        pad.loss_mask,
        kind,
        0.2,
    )
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)


def _padded_grad(b, x):
    am = unpack(b).attention_mask
    return torch.zeros(am.shape, dtype=x.dtype).masked_scatter(am, x)


def test_bad_knobs_and_missing_inputs_are_named():
    from megarl.batch import from_sequences

    b = from_sequences([[1, 2]], [[3, 4, 5]], [0])
    b.rewards = torch.tensor([1.0], dtype=torch.float64)
    b.values = torch.zeros(b.num_tokens, dtype=torch.float64)
    with pytest.raises(ValueError, match="attention_concentration"):
        COMP(b)
    b.token_extras[CONCENTRATION] = torch.zeros(b.num_tokens, dtype=torch.float64)
    with pytest.raises(ValueError, match="advantage.g_min"):
        COMP(b, g_min=0.9, g_max=0.5)
    with pytest.raises(ValueError, match="inputs.attention_concentration: statistic"):
        build_knobs(ConcentrationKnobs, {"statistic": "gini"}, "inputs.attention_concentration")
    with pytest.raises(ValueError, match="inputs.attention_concentration: layers"):
        build_knobs(ConcentrationKnobs, {"layers": []}, "inputs.attention_concentration")


def test_tac_router_features_widen_the_head_of_an_moe_policy_only():
    """TAC's φ(router): n_moe_layers · num_experts more inputs; a dense policy is refused."""
    import json

    from megarl.methods.critics.trunk import feature_size
    from megarl.testing.tiny_qwen3 import find_tiny_qwen3_fixture

    dense = json.loads((find_tiny_qwen3_fixture() / "config.json").read_text())
    assert feature_size(dense, False) == dense["hidden_size"]
    with pytest.raises(ValueError, match="inputs.values.router: true needs an MoE policy"):
        feature_size(dense, True)
    moe = dict(dense, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert feature_size(moe, True) == dense["hidden_size"] + dense["num_hidden_layers"] * 4
