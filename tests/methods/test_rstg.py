"""RSTG: megarl (prepared on every DP shard, TP 1/2, micro-batched) equals
reference/distillation.py:rstg_loss in loss and gradient, and the method's invariants: no
distillation or SFT gradient outside all-wrong groups, pure GRPO without them, the token gate keeps
the requested fractions of the global batch, c_i in (0, 1], teacher solutions outside the advantages."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.distillation as rd
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.batch import from_sequences, unpack
from megarl.methods.distillation.rstg import WEIGHT, prepare, token_gate
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective
from megarl.testing.equivalence import split_sequences
from megarl.testing.simulated_group import SimulatedWorld
from tests.methods.helpers import load_example
from tests.methods.trust_regions_harness import (
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases

KNOBS = st.fixed_dictionaries(
    {
        "alpha": st.sampled_from([1.0, 0.5]),
        "gamma": st.sampled_from([0.0, 0.3]),
        "rho_entropy": st.sampled_from([0.0, 0.2, 0.5, 1.0]),
        "rho_divergence": st.sampled_from([0.0, 0.3]),
    }
)
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
CFGS = st.builds(
    lambda agg, knobs: ObjectiveConfig(policy_loss="rstg", aggregation=agg, policy_loss_args=knobs),
    st.sampled_from(AGGS),
    KNOBS,
)


def _set_up(case, data, dp):
    """0/1 rewards (many all-wrong groups), teacher solutions, entropies, RSTG advantages; groups
    never straddle the DP split."""
    b = case.batch
    B = b.num_seqs
    side = torch.zeros(B, dtype=torch.long)
    for r, ids in enumerate(split_sequences(B, dp)):
        side[ids] = r
    b.group_ids = b.group_ids * dp + side
    b.rewards = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.0, 1.0]), min_size=B, max_size=B)))
    sol = data.draw(st.lists(st.booleans(), min_size=B, max_size=B))
    b.extras = {"teacher_solution": torch.tensor(sol, dtype=torch.float64)}
    g = torch.Generator().manual_seed(B)
    b.entropies = torch.rand(b.num_tokens, generator=g, dtype=torch.float64) * 2
    b.advantages = ADVANTAGE_ESTIMATORS.get("rstg")(b)


def _reference(case):
    cfg = case.cfg

    def fn(full, pad):
        logp, old, adv, mask = padded_inputs(full, pad)
        tok = pad.per_token
        return rd.rstg_loss(
            logp,
            old,
            adv,
            mask,
            tok["teacher_logprobs"],
            tok["entropies"],
            pad.per_seq["rewards"],
            pad.per_seq["group_ids"],
            case.batch.extras["teacher_solution"].bool(),
            aggregation=cfg.aggregation,
            **cfg.policy_loss_args,
        )

    return reference_method_loss_and_grad(case, fn)


@settings(max_examples=15)
@given(
    case=rl_cases(torch.float64, cfgs=CFGS),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
    data=st.data(),
)
def test_matches_reference(case, tp, dp, mb, data):
    _set_up(case, data, dp)
    b = case.batch
    want_adv = rd.rstg_advantages(b.rewards, b.group_ids, ~b.extras["teacher_solution"].bool())
    torch.testing.assert_close(b.advantages, want_adv[b.seq_index()] * b.loss_mask.double())
    mb = min(mb, -(-b.num_seqs // dp))
    assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, mb), _reference(case), case.logits)


def _batch(rewards, groups, lens=(3, 2, 4, 3, 2, 3), V=7, seed=0, solutions=None):
    g = torch.Generator().manual_seed(seed)
    b = from_sequences(
        [[1]] * len(rewards), [torch.randint(0, V, (n,), generator=g).tolist() for n in lens], groups
    )
    T = b.num_tokens
    b.rewards = torch.tensor(rewards, dtype=torch.float64)
    b.extras = {} if solutions is None else {"teacher_solution": torch.tensor(solutions, dtype=torch.float64)}
    b.entropies = torch.rand(T, generator=g, dtype=torch.float64) * 2
    b.teacher_logprobs = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    logits = torch.randn(T, V, generator=g, dtype=torch.float64)
    b.old_logprobs = torch.log_softmax(logits, -1)[torch.arange(T), b.tokens]
    b.advantages = ADVANTAGE_ESTIMATORS.get("rstg")(b)
    return b, logits


def _loss_grad(b, logits, **args):
    obj = build_objective({"policy_loss": args.pop("loss", "rstg"), "policy_loss_args": args})
    b = obj.prepare(b, None)
    logits = logits.clone().requires_grad_(True)
    out = obj(logits, b, LossContext(GlobalNormalisers.from_batch(b)))
    out.loss.backward()
    return out, logits.grad


def test_no_distillation_or_sft_gradient_outside_all_wrong_groups():
    b, logits = _batch([0, 0, 1, 0, 1, 1], [0, 0, 1, 1, 2, 2], solutions=[0, 1, 0, 1, 0, 1])
    b.advantages = torch.zeros_like(b.advantages)  # the GRPO part silent: what is left is OPD + SFT
    _, grad = _loss_grad(b, logits, rho_entropy=1.0, rho_divergence=1.0)
    rows = torch.repeat_interleave(torch.tensor([True, True, False, False, False, False]), b.seq_lens)
    assert grad[rows].abs().sum() > 0 and torch.all(grad[~rows] == 0)


def test_without_all_wrong_groups_it_is_grpo():
    b, logits = _batch([0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 2, 2])
    got, g1 = _loss_grad(b, logits, alpha=2.0, gamma=3.0, rho_entropy=1.0, rho_divergence=1.0)
    want, g2 = _loss_grad(b, logits, loss="ppo")
    assert torch.equal(got.loss, want.loss) and torch.equal(g1, g2)
    assert float(got.metrics["rstg/distilled_token_frac"]) == 0.0


@settings(max_examples=10)
@given(seed=st.integers(0, 1000), rho_h=st.floats(0, 1), dp=st.sampled_from([1, 2, 3]))
def test_entropy_gate_keeps_the_requested_fraction_of_the_global_batch(seed, rho_h, dp):
    b, _ = _batch([0] * 6, [0, 0, 1, 1, 2, 2], seed=seed)  # every group all-wrong
    shards = split_sequences(b.num_seqs, dp)
    gates = SimulatedWorld(dp).run(
        lambda r, g: token_gate(prepare(b.select(shards[r]), g, rho_entropy=rho_h, rho_divergence=0.0))
    )
    whole = token_gate(prepare(b, None, rho_entropy=rho_h, rho_divergence=0.0))
    assert torch.equal(torch.cat(gates), whole)
    m = b.loss_mask.bool()
    n = int(m.sum())
    assert int((whole & m).sum()) == min(n, max(0, -int(-(rho_h * n - 1e-9) // 1)))


@given(t=st.lists(st.floats(-30, 0), min_size=3, max_size=3))
def test_confidence_is_in_0_1(t):
    b = from_sequences([[1]], [[2, 3, 4]], [0], rewards=[0.0])
    b.teacher_logprobs = torch.tensor([0.0, *t], dtype=torch.float64)
    b.old_logprobs = torch.zeros(4, dtype=torch.float64)
    b.entropies = torch.ones(4, dtype=torch.float64)
    w = prepare(b, None).extras[WEIGHT]
    assert 0 < float(w[0]) <= 1


def test_teacher_solutions_stay_out_of_the_advantages_and_the_all_wrong_test():
    b, _ = _batch([0, 0, 1, 0, 1, 0], [0, 0, 0, 1, 1, 1], solutions=[0, 0, 1, 0, 0, 0])
    adv = unpack(b).per_token["advantages"]
    assert torch.all(adv[2] == 0) and torch.all(adv[:2] == 0)  # group 0's students: all wrong, no spread
    p = prepare(b, None)
    assert p.extras["rstg_sft"].tolist() == [0, 0, 1, 0, 0, 0]
    assert bool((p.extras[WEIGHT][:2] > 0).all()) and bool((p.extras[WEIGHT][2:] == 0).all())


def test_missing_fields_and_prepare_are_named():
    b, logits = _batch([0, 0, 1, 0, 1, 1], [0, 0, 1, 1, 2, 2])
    with pytest.raises(ValueError, match="teacher_logprobs"):
        prepare(dataclasses.replace(b, teacher_logprobs=None), None)
    with pytest.raises(ValueError, match="entropies"):
        prepare(dataclasses.replace(b, entropies=None), None)
    bad = dataclasses.replace(b, extras={"teacher_solution": torch.zeros(2)})
    with pytest.raises(ValueError, match="teacher_solution"):
        prepare(bad, None)
    obj = build_objective({"policy_loss": "rstg"})
    with pytest.raises(ValueError, match="objective.prepare"):
        obj(logits, b, LossContext(GlobalNormalisers(4, 4)))


def test_example_loads():
    cfg = load_example("rstg")
    assert cfg["advantage"]["estimator"] == "rstg" and cfg["objective"]["policy_loss"] == "rstg"
