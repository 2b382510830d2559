"""megarl's packed, vectorised advantage estimators equal reference/advantages.py (padded loops),
plus the estimators' invariants."""

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import reference.advantages as ra
from megarl.advantages import estimators as ma
from megarl.batch import unpack
from tests.property.strategies import build_batch, packed_structure


@st.composite
def reward_batches(draw):
    prompt, resp, gids, holes = draw(packed_structure(max_group_size=5, max_response=6))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = torch.Generator().manual_seed(seed)
    b = build_batch(prompt, resp, gids, holes, 8, rng, torch.float64)
    kind = draw(st.sampled_from(["binary", "gauss", "constant"]))
    if kind == "binary":
        r = torch.randint(0, 2, (b.num_seqs,), generator=rng).double()
    elif kind == "gauss":
        r = torch.randn(b.num_seqs, generator=rng, dtype=torch.float64)
    else:
        r = torch.full((b.num_seqs,), 0.7, dtype=torch.float64)
    b.rewards = r
    b.values = torch.randn(b.num_tokens, generator=rng, dtype=torch.float64)
    b.token_rewards = torch.randn(b.num_tokens, generator=rng, dtype=torch.float64)
    return b


def _close(x, y):
    torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


@given(reward_batches(), st.booleans())
def test_grpo_matches_reference_and_sums_to_zero_per_group(b, scale):
    adv = ma.grpo(b.rewards, b.group_ids, scale_by_std=scale)
    _close(adv, ra.grpo(b.rewards, b.group_ids, scale_by_std=scale))
    for g in torch.unique(b.group_ids):
        assert abs(float(adv[b.group_ids == g].sum())) < 1e-9


@given(reward_batches())
def test_rloo_matches_reference_and_closed_form(b):
    adv = ma.rloo(b.rewards, b.group_ids)
    _close(adv, ra.rloo(b.rewards, b.group_ids))
    # closed form: A_i = G/(G-1) · (R_i - mean_g R) for groups of size G > 1
    for g in torch.unique(b.group_ids):
        sel = b.group_ids == g
        G = int(sel.sum())
        if G > 1:
            _close(adv[sel], G / (G - 1) * (b.rewards[sel] - b.rewards[sel].mean()))


@given(reward_batches())
def test_zero_variance_group_gets_zero_advantage(b):
    b.rewards = torch.zeros_like(b.rewards) + 0.3
    for est in ("grpo", "dr_grpo", "rloo"):
        adv = ma.ADVANTAGE_ESTIMATORS.get(est)(b)
        assert torch.all(adv == 0), est


@given(reward_batches(), st.sampled_from([1.0, 0.9]), st.sampled_from([1.0, 0.95, 0.0]))
def test_gae_matches_reference(b, gamma, lam):
    adv, ret = ma.gae(b.token_rewards, b.values, b.loss_mask, b.cu_seqlens, gamma, lam)
    p = unpack(b)
    radv, rret = ra.gae(p.per_token["token_rewards"], p.per_token["values"], p.loss_mask, gamma, lam)
    _close(adv, radv[p.attention_mask])
    _close(ret, rret[p.attention_mask])


@given(reward_batches())
def test_gae_with_lambda_one_and_zero_values_is_the_return(b):
    adv, _ = ma.gae(b.token_rewards, torch.zeros_like(b.values), b.loss_mask, b.cu_seqlens, 1.0, 1.0)
    m = b.loss_mask
    for i in range(b.num_seqs):
        s, e = int(b.cu_seqlens[i]), int(b.cu_seqlens[i + 1])
        r = (b.token_rewards[s:e] * m[s:e]).flip(0).cumsum(0).flip(0) * m[s:e]
        _close(adv[s:e], r)


@given(reward_batches(), st.sampled_from([0.0, 0.1]))
def test_reinforce_pp_matches_reference(b, kl_coef):
    assume(b.loss_mask.sum() >= 2)
    kl = torch.randn(b.num_tokens, dtype=torch.float64) * b.loss_mask
    p = unpack(b)
    pk = torch.zeros_like(p.loss_mask)
    pk[p.attention_mask] = kl
    _close(
        ma.reinforce_pp(b, kl, kl_coef)[b.loss_mask.bool()],
        ra.reinforce_pp(b.rewards, p.loss_mask, pk, kl_coef)[p.attention_mask][b.loss_mask.bool()],
    )
    _close(
        ma.reinforce_pp_baseline(b)[b.loss_mask.bool()],
        ra.reinforce_pp_baseline(b.rewards, b.group_ids, p.loss_mask)[p.attention_mask][b.loss_mask.bool()],
    )
