"""SAPO: the turn-level GAE (actions are runs of loss tokens) equals reference/critics.py
``sapo_turn_gae`` + ``batch_normalise``; PPO on SAPO's advantages equals the reference in loss and
gradient under TP, DP and micro-batch splits; the value head's boundary loss (λ-return regression
plus SARSA) equals ``sapo_head_loss`` in loss and gradient; and the spec's invariants (Â has mean
0 and std 1 over the batch, λ = γ = 1 with V ≡ 0 gives the return-to-go, no gradient at
non-boundary positions, values read only at boundaries, no second model)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.critics as rc
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import token_rewards
from megarl.batch import from_sequences, unpack
from megarl.methods.critics.critic import CriticKnobs, build_values
from megarl.methods.critics.sapo import turn_advantages
from megarl.methods.critics.trunk import TrunkCritic, TrunkHead, action_spans, boundary_head_loss
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.plugin.knobs import build_knobs
from megarl.testing.equivalence import megarl_loss_and_grad, reference_loss_and_grad
from tests.property.strategies import rl_cases
from tests.property.test_advantages import reward_batches

SAPO = ADVANTAGE_ESTIMATORS.get("sapo_gae")


def _turns(b):
    """Per trajectory (reference layout): action spans, turn rewards, V(s_t) from the padded batch."""
    pad = unpack(b)
    am = pad.attention_mask
    r = torch.zeros(am.shape, dtype=torch.float64)
    r[am] = token_rewards(b)
    v = torch.zeros(am.shape, dtype=torch.float64)
    v[am] = b.values.double()
    spans = [rc.action_spans(pad.loss_mask[i]) for i in range(b.num_seqs)]
    rewards = [[float(r[i, f : end + 1].sum()) for f, end in sp] for i, sp in enumerate(spans)]
    values = [[float(v[i, f]) for f, _ in sp] for i, sp in enumerate(spans)]
    return pad, spans, rewards, values


def _reference(b, gamma, lam):
    """reference Â (normalised, on every token of each action) and G^λ, packed [T]."""
    pad, spans, rewards, values = _turns(b)
    advs, rets = rc.sapo_turn_gae(rewards, values, gamma, lam)
    norm = rc.batch_normalise(advs)
    A = torch.zeros(pad.attention_mask.shape, dtype=torch.float64)
    G = torch.zeros_like(A)
    for i, sp in enumerate(spans):
        for t, (f, end) in enumerate(sp):
            A[i, f : end + 1] = norm[i][t]
            G[i, f : end + 1] = rets[i][t]
    return A[pad.attention_mask], G[pad.attention_mask]


@settings(max_examples=8, deadline=None)
@given(reward_batches(), st.sampled_from([1.0, 0.9]), st.sampled_from([1.0, 0.95, 0.0]), st.booleans())
def test_turn_gae_matches_reference(b, gamma, lam, outcome_only):
    if outcome_only:
        b.token_rewards = None
    adv = SAPO(b, gamma=gamma, lam=lam)
    want, want_ret = _reference(b, gamma, lam)
    torch.testing.assert_close(adv, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(b.returns.double(), want_ret, rtol=1e-10, atol=1e-10)
    # Â over the batch's actions: mean 0, std 1 (std(A) ≫ eps = 1e-8; all 0 when the A are all equal)
    first, _, _, _ = action_spans(b)
    a, raw = adv[first], turn_advantages(b, gamma, lam)[0]
    if raw.numel() > 1 and float(raw.std()) > 1e-4:
        assert abs(float(a.mean())) < 1e-9 and abs(float(a.std()) - 1.0) < 1e-6
    elif raw.numel() and bool(raw.max() == raw.min()):
        assert bool((a == 0).all())


def test_lambda_one_gamma_one_zero_values_give_the_return_to_go():
    """Two trajectories with 3 and 2 actions (observations masked out between them)."""
    b = from_sequences([[1, 2], [1]], [[3, 4, 5, 6, 7, 8, 9], [3, 4, 5, 6]], [0, 1])
    b.loss_mask = b.loss_mask.clone()
    b.loss_mask[[4, 7]] = 0.0  # seq 0: actions {2,3}, {5,6}, {8}; seq 1 (starts at 9): {10,11}, {13}
    b.loss_mask[[9 + 3]] = 0.0
    b.rewards = torch.tensor([1.0, 2.0], dtype=torch.float64)
    b.token_rewards = torch.zeros(b.num_tokens, dtype=torch.float64)
    b.token_rewards[[3, 6, 8, 11, 13]] = torch.tensor([0.5, 0.25, 1.0, -1.0, 2.0], dtype=torch.float64)
    b.values = torch.zeros(b.num_tokens, dtype=torch.float64)
    adv, ret, _ = turn_advantages(b, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([1.75, 1.25, 1.0, 1.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(ret, adv)


def _sapo_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b = from_sequences([[1, 2], [1, 2, 3]], [[4, 5, 6, 7, 8, 9], [4, 5, 6, 7]], [0, 1])
    b.loss_mask = b.loss_mask.clone()
    b.loss_mask[4] = 0.0  # seq 0: actions {2,3} and {5,6,7}; seq 1: one action {9..12}
    b.rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    b.token_rewards = None
    b.values = torch.randn(b.num_tokens, generator=g, dtype=torch.float64)
    SAPO(b)
    return b


@settings(max_examples=5, deadline=None)
@given(reward_batches(), st.integers(0, 2**31 - 1), st.sampled_from([1.0, 0.9]), st.sampled_from([0.0, 0.5]))
def test_head_loss_matches_reference_in_loss_and_gradient(b, seed, gamma, c_q):
    """V(s_t) = head(h at the last token before action t), Q = head(h at its last token)."""
    g = torch.Generator().manual_seed(seed)
    SAPO(b, gamma=gamma)
    head = TrunkHead(5, 4, seed).double()
    with torch.no_grad():
        head.out.weight.normal_(generator=g)
    h = torch.randn(b.num_tokens, 5, generator=g, dtype=torch.float64)
    got, _ = boundary_head_loss(head, h, b, token_rewards(b), gamma, c_q)
    if action_spans(b)[0].numel() == 0:  # no loss tokens: nothing to regress
        assert float(got.detach()) == 0.0
        return
    got_grads = torch.autograd.grad(got, list(head.parameters()))
    pad, spans, rewards, _ = _turns(b)
    G = torch.zeros(pad.attention_mask.shape, dtype=torch.float64)
    G[pad.attention_mask] = b.returns.double()
    hp = torch.zeros(*pad.attention_mask.shape, 5, dtype=torch.float64)
    hp[pad.attention_mask] = h
    v_state = [head(hp[i, [f - 1 for f, _ in sp]]) for i, sp in enumerate(spans)]
    q_action = [head(hp[i, [end for _, end in sp]]) for i, sp in enumerate(spans)]
    targets = [[float(G[i, f]) for f, _ in sp] for i, sp in enumerate(spans)]
    want = rc.sapo_head_loss(v_state, q_action, rewards, targets, gamma, 1.0, c_q)
    want_grads = torch.autograd.grad(want, list(head.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, w in zip(got_grads, want_grads):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-12)


def test_head_reads_and_trains_only_at_the_boundaries():
    """Zero gradient to every non-boundary position; changing h there changes nothing."""
    b = _sapo_batch()
    first, last, _, _ = action_spans(b)
    boundary = torch.zeros(b.num_tokens, dtype=torch.bool)
    boundary[first - 1] = True
    boundary[last] = True
    head = TrunkHead(4, 3, 0).double()
    with torch.no_grad():
        head.out.weight.fill_(0.3)
    h = torch.randn(b.num_tokens, 4, dtype=torch.float64, requires_grad=True)
    loss, _ = boundary_head_loss(head, h, b, token_rewards(b), 1.0, 1.0)
    loss.backward()
    assert bool((h.grad[~boundary] == 0).all()) and bool((h.grad[boundary].abs().sum(-1) > 0).all())
    h2 = h.detach().clone()
    h2[~boundary] = 100.0
    again, _ = boundary_head_loss(head, h2, b, token_rewards(b), 1.0, 1.0)
    assert torch.equal(again, loss.detach())


class _Ctx:
    """What TrunkCritic reads from the run context; ``make_learner`` refuses (no second model)."""

    def __init__(self):
        from types import SimpleNamespace as NS

        self.cfg = NS(model=NS(seed=1), advantage=NS(knobs={"gamma": 1.0}), optimizer=NS(clip_grad=1.0))
        self.policy, self.hf_config = None, {"hidden_size": 16}

    def make_learner(self, *a, **k):
        raise AssertionError("a trunk value head must not build a second model")


def test_trunk_values_build_no_second_model_and_train_the_head():
    knobs = build_knobs(
        CriticKnobs, {"model": "trunk", "boundaries": True, "sarsa_coef": 1.0}, "inputs.values"
    )
    part = build_values(_Ctx(), knobs)
    assert isinstance(part, TrunkCritic)
    assert sum(p.numel() for p in part.head.parameters()) == 16 * 64 + 64 + 64 + 1
    b = _sapo_batch()
    part._hidden = torch.randn(b.num_tokens, 16, generator=torch.Generator().manual_seed(1))
    part.before_train(1, b)
    before = part.loss(b, part._hidden)[0].item()
    for step in range(1, 6):
        part._batch, hidden = b, part._hidden
        m = part.after_step(step, {})
        part._hidden = hidden
    assert m["critic/value_loss"] >= 0 and part.loss(b, part._hidden)[0].item() < before
    state = part.state_dict()
    fresh = build_values(_Ctx(), knobs)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.head.out.weight, part.head.out.weight)


@settings(max_examples=10, deadline=None)
@given(
    rl_cases(torch.float64, cfgs=st.just(ObjectiveConfig(policy_loss="ppo", aggregation="token-mean"))),
    st.integers(0, 2**31 - 1),
    st.sampled_from([(1, 1, 1), (2, 2, 2), (1, 2, 3), (2, 1, 2)]),
)
def test_ppo_on_sapo_advantages_matches_reference_loss_and_gradient(case, seed, split):
    b = case.batch
    g = torch.Generator().manual_seed(seed)
    b.token_rewards = None
    b.values = torch.randn(b.num_tokens, generator=g, dtype=torch.float64)
    b.advantages = SAPO(b) * b.loss_mask
    want, _ = _reference(b, 1.0, 1.0)
    tp, dp, mb = split
    loss, grad = megarl_loss_and_grad(case, tp=tp, dp=dp, micro_batches=mb)
    ref_case = dataclasses.replace(case, batch=dataclasses.replace(b, advantages=want * b.loss_mask))
    ref_loss, ref_grad = reference_loss_and_grad(ref_case)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-10)


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="inputs.values: model"):
        build_knobs(CriticKnobs, {"model": "separate"}, "inputs.values")
    with pytest.raises(ValueError, match="boundaries, sarsa_coef and router need model: trunk"):
        build_knobs(CriticKnobs, {"router": True}, "inputs.values")
    with pytest.raises(ValueError, match="inputs.values: context: true needs model: critic"):
        build_knobs(CriticKnobs, {"model": "trunk", "context": True}, "inputs.values")
    b = _sapo_batch()
    b.values = None
    with pytest.raises(ValueError, match="sapo_gae needs the batch field 'values'"):
        SAPO(b)
