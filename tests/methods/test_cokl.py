"""CoKL: megarl (prepared group weights, micro-batched, TP 1/2, DP 1/2) equals
reference/trust_regions.py:cokl (loss and gradient) when the old log-probs are the current policy's,
is its first-order expansion otherwise, and satisfies the method's invariants."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.batch import from_sequences, unpack
from megarl.methods.trust_regions.cokl import prepare
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective
from megarl.testing.equivalence import split_sequences
from reference import trust_regions as ref
from reference.policy_losses import ppo_clip
from tests.methods.trust_regions_harness import (
    aggregate,
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases

KNOBS = st.fixed_dictionaries(
    {"temperature": st.sampled_from([1.0, 0.5]), "length_normalise": st.booleans(), "dedup": st.booleans()}
)
CFGS = st.builds(
    lambda agg, knobs: ObjectiveConfig(
        policy_loss="ppo", aggregation=agg, regularisers=[{"name": "cokl", "coef": 0.5, **knobs}]
    ),
    st.sampled_from(["token-mean", "seq-mean-token-mean"]),
    KNOBS,
)


def _ref_cokl(logp, pad, knobs, correct):
    lengths = pad.attention_mask.sum(-1)
    return ref.cokl(
        logp,
        pad.per_token["ref_logprobs"],
        pad.loss_mask,
        pad.tokens,
        pad.per_seq["prompt_lens"],
        lengths,
        pad.per_seq["group_ids"],
        correct,
        **knobs,
    )


def _reference(case, correct):
    cfg = case.cfg
    knobs = {k: v for k, v in cfg.regularisers[0].items() if k not in ("name", "coef")}

    def fn(full, pad):
        logp, old, adv, _ = padded_inputs(full, pad)
        return aggregate(ppo_clip(logp, old, adv), pad, cfg.aggregation) + 0.5 * _ref_cokl(
            logp, pad, knobs, correct
        )

    return reference_method_loss_and_grad(case, fn)


def _set_up(case, data, dp, on_policy=True):
    """Random correctness bits; groups never straddle the DP split; old = current log-probs."""
    b = case.batch
    correct = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b.num_seqs, max_size=b.num_seqs)))
    side = torch.zeros(b.num_seqs, dtype=torch.long)
    for r, ids in enumerate(split_sequences(b.num_seqs, dp)):
        side[ids] = r
    b.group_ids = b.group_ids * dp + side
    b.extras = {"correct": correct}
    if on_policy:
        b.old_logprobs = torch.log_softmax(case.logits, -1)[torch.arange(b.num_tokens), b.tokens]
    return correct


@settings(max_examples=12)
@given(
    case=rl_cases(torch.float64, cfgs=CFGS, min_group_size=2),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
    data=st.data(),
)
def test_matches_reference_on_policy(case, tp, dp, mb, data):
    correct = _set_up(case, data, dp)
    assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, mb), _reference(case, correct), case.logits)


@settings(max_examples=8)
@given(case=rl_cases(torch.float64, cfgs=CFGS, min_group_size=2), data=st.data())
def test_is_the_first_order_expansion_at_the_old_logprobs(case, data):
    """Off-policy (old ≠ current): L(s⁰) + ∇L(s⁰)·(s − s⁰), the reference differentiated at old."""
    correct = _set_up(case, data, 1, on_policy=False)
    knobs = {k: v for k, v in case.cfg.regularisers[0].items() if k not in ("name", "coef")}
    case = dataclasses.replace(case, cfg=dataclasses.replace(case.cfg, policy_loss="none"))

    def fn(full, pad):
        logp, old, _, _ = padded_inputs(full, pad)
        old = old.clone().requires_grad_(True)
        l0 = _ref_cokl(old, pad, knobs, correct)
        g = torch.autograd.grad(l0, old)[0] if l0.requires_grad else torch.zeros_like(old)
        return 0.5 * (l0.detach() + (g * pad.loss_mask * (logp - old.detach())).sum())

    assert_equivalent(
        megarl_method_loss_and_grad(case, tp=2, micro_batches=2),
        reference_method_loss_and_grad(case, fn),
        case.logits,
    )


def _rand_group(correct, lens=(2, 3, 1, 2), V=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = from_sequences(
        [[1]] * len(lens), [torch.randint(0, V, (n,), generator=g).tolist() for n in lens], [0] * len(lens)
    )
    b.extras = {"correct": torch.tensor(correct)}
    T = b.num_tokens
    b.old_logprobs = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    b.ref_logprobs = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    b.advantages = torch.zeros(T, dtype=torch.float64)
    return b


def _seq_shift(b, shift_per_seq):
    """Add c_i/n_i to every loss token of sequence i, so s_i moves by c_i."""
    n = unpack(b).loss_mask.sum(-1)
    per_tok = torch.repeat_interleave(
        torch.tensor(shift_per_seq, dtype=torch.float64) / n.clamp(min=1), b.seq_lens
    )
    return per_tok * b.loss_mask


@given(c=st.floats(-5, 5), seed=st.integers(0, 1000), ln=st.booleans())
def test_invariant_to_shifting_correct_logprobs_by_a_constant(c, seed, ln):
    b = _rand_group([True, True, False, True], seed=seed)
    base = prepare(b, None, length_normalise=ln)
    correct = b.extras["correct"].double()
    shift = _seq_shift(b, (c * correct).tolist())
    if ln:  # a constant on the length-normalised log-likelihood s_i / n_i
        shift = shift * torch.repeat_interleave(unpack(b).loss_mask.sum(-1), b.seq_lens)
    moved = prepare(dataclasses.replace(b, old_logprobs=b.old_logprobs + shift), None, length_normalise=ln)
    for k in ("cokl_value", "cokl_grad_weight"):
        torch.testing.assert_close(moved.extras[k], base.extras[k], rtol=1e-10, atol=1e-12)
    n = unpack(b).loss_mask.sum(-1) if ln else 1.0  # weights are per token: ∂L/∂s_i = w_i·n_i when normalised
    torch.testing.assert_close(
        (base.extras["cokl_grad_weight"] * n).sum(),
        torch.tensor(0.0, dtype=torch.float64),
        atol=1e-12,
        rtol=0,
    )


def _objective_grad(b, coef=1.0):
    obj = build_objective({"policy_loss": "none", "regularisers": [{"name": "cokl", "coef": coef}]})
    b = obj.prepare(b, None)
    logits = torch.randn(b.num_tokens, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    b.tokens = b.tokens % 6
    b.old_logprobs = torch.log_softmax(logits, -1)[torch.arange(b.num_tokens), b.tokens]
    b = obj.prepare(b, None)
    logits.requires_grad_(True)
    out = obj(logits, b, LossContext(GlobalNormalisers(float(b.loss_mask.sum()), float(b.num_seqs))))
    out.loss.backward()
    return out.loss.detach(), logits.grad


def test_incorrect_samples_get_zero_gradient():
    b = _rand_group([True, False, True, False], lens=(2, 3, 2, 2))
    loss, grad = _objective_grad(b)
    rows = torch.repeat_interleave(~b.extras["correct"], b.seq_lens)
    assert loss > 0
    assert torch.all(grad[rows] == 0) and grad[~rows].abs().sum() > 0


@given(seed=st.integers(0, 1000))
def test_nonnegative_and_zero_iff_relative_likelihoods_match(seed):
    b = _rand_group([True, True, True, False], seed=seed)
    assert float(prepare(b, None).extras["cokl_value"].sum()) >= 0
    same = dataclasses.replace(b, ref_logprobs=b.old_logprobs + _seq_shift(b, [0.7] * 4))
    out = prepare(same, None).extras
    assert float(out["cokl_value"].sum()) == pytest.approx(0.0, abs=1e-12)
    assert float(out["cokl_grad_weight"].abs().max()) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("correct", [[False] * 4, [True, False, False, False]])
def test_fewer_than_two_correct_gives_zero(correct):
    loss, grad = _objective_grad(_rand_group(correct))
    assert float(loss) == 0.0 and torch.all(grad == 0)


def test_duplicates_count_once():
    b = from_sequences([[1]] * 3, [[4, 5], [4, 5], [6]], [0, 0, 0])
    b.extras = {"correct": torch.tensor([True] * 3)}
    b.old_logprobs = torch.tensor([0, -1.0, -2.0, 0, -1.0, -2.0, 0, -0.5], dtype=torch.float64)
    b.ref_logprobs = torch.tensor([0, -2.0, -0.5, 0, -2.0, -0.5, 0, -4.0], dtype=torch.float64)
    out = prepare(b, None).extras
    assert out["cokl_grad_weight"][1] == 0 and out["cokl_value"][1] == 0
    two = prepare(b.select([0, 2]), None).extras
    torch.testing.assert_close(out["cokl_value"].sum(), two["cokl_value"].sum())


def test_missing_prepare_and_fields_are_named():
    b = _rand_group([True, True, False, True])
    with pytest.raises(ValueError, match="ref_logprobs"):
        prepare(dataclasses.replace(b, ref_logprobs=None), None)
    obj = build_objective({"regularisers": [{"name": "cokl", "coef": 0.1}]})
    with pytest.raises(ValueError, match="objective.prepare"):
        obj(torch.randn(b.num_tokens, 12), b, LossContext(GlobalNormalisers(4, 4)))


def test_bandit_keeps_reference_proportions_while_correct_mass_goes_to_one():
    """Tabular bandit, actions (c1, c2, wrong), π_ref = (.3, .1, .6), R = 1 on c1, c2. With the whole
    support as the group, the finite-group CoKL is the population CoKL (checked against the
    reference). Maximising E[R] − β·CoKL keeps c1:c2 = 3:1 while π(C) → 1; the reverse-KL optimum
    π ∝ π_ref·e^{R/β} keeps a correctness gap."""
    ref_p = torch.tensor([0.3, 0.1, 0.6], dtype=torch.float64)
    beta = 0.5

    def population_cokl(logp):
        rc, qc = torch.log_softmax(torch.log(ref_p[:2]), 0), torch.log_softmax(logp[:2], 0)
        return (rc.exp() * (rc - qc)).sum()

    def reference_cokl(logp):
        return ref.cokl(
            logp[:2, None],
            torch.log(ref_p)[:2, None],
            torch.ones(2, 1),
            torch.tensor([[0], [1]]),
            torch.zeros(2, dtype=torch.long),
            torch.ones(2, dtype=torch.long),
            torch.zeros(2),
            torch.ones(2, dtype=torch.bool),
        )

    probe = torch.log_softmax(torch.tensor([0.4, -1.0, 0.2], dtype=torch.float64), 0)
    torch.testing.assert_close(reference_cokl(probe), population_cokl(probe))
    z = torch.log(ref_p).clone().requires_grad_(True)
    opt = torch.optim.Adam([z], lr=0.05)
    for _ in range(300):
        logp = torch.log_softmax(z, 0)
        objective = logp[:2].exp().sum() - beta * population_cokl(logp)
        opt.zero_grad()
        (-objective).backward()
        opt.step()
    p = torch.softmax(z.detach(), 0)
    assert float(p[0] / p[1]) == pytest.approx(3.0, rel=1e-3)
    assert float(p[:2].sum()) > 0.99
    kl_opt = ref_p * torch.exp(torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64) / beta)
    assert float((kl_opt / kl_opt.sum())[:2].sum()) < 0.9  # full-policy KL keeps a correctness gap


def test_data_parallel_shares_prepare_the_whole_batch_weights():
    """The active-group count is global: two DP ranks holding one active group each divide by 2,
    as the whole batch on one rank does (a per-rank count would divide by 1)."""
    from megarl.testing.simulated_group import SimulatedWorld

    g = torch.Generator().manual_seed(3)
    lens = [2, 3, 1, 2, 3, 2, 2, 1]
    b = from_sequences(
        [[1]] * 8, [torch.randint(0, 9, (n,), generator=g).tolist() for n in lens], [0, 0, 0, 0, 1, 1, 1, 1]
    )
    b.extras = {"correct": torch.tensor([True, True, False, True, True, False, True, True])}
    b.old_logprobs = -torch.rand(b.num_tokens, generator=g, dtype=torch.float64) * 3
    b.ref_logprobs = -torch.rand(b.num_tokens, generator=g, dtype=torch.float64) * 3
    whole = prepare(b, None).extras
    shards = SimulatedWorld(2).run(lambda r, grp: prepare(b.select(range(4 * r, 4 * r + 4)), grp).extras)
    for k in ("cokl_value", "cokl_grad_weight"):
        assert whole[k].abs().sum() > 0
        torch.testing.assert_close(torch.cat([s[k] for s in shards]), whole[k], rtol=1e-12, atol=1e-14)
