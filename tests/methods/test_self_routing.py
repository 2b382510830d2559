"""Self-Routing: the routes equal reference/distillation.py:self_routing_routes and the loss and
gradient equal self_routing_loss (prepared on every DP shard, TP 1/2, micro-batched); the spec's
invariants: all-mixed is GRPO exactly, skipped groups give zero gradient and leave the others'
normalisation alone, routes ignore the order inside a group, OPSD vanishes when the self-teacher
equals the student, the route histogram sums to the number of groups."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.distillation as rd
from megarl.batch import from_sequences, unpack
from megarl.methods.distillation.routes import route_metrics, set_routes
from megarl.methods.distillation.self_routing import NAMES, self_routing_rule
from megarl.methods.distillation.self_teacher import CORRECT, ON
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective
from megarl.testing.equivalence import split_sequences
from tests.methods.helpers import load_example
from tests.methods.trust_regions_harness import (
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
CFGS = st.builds(
    lambda agg, sd, reg: ObjectiveConfig(
        policy_loss="self_routing",
        aggregation=agg,
        policy_loss_args={"aggregation": agg, "sd_coef": sd, "reg_coef": reg},
    ),
    st.sampled_from(AGGS),
    st.sampled_from([1.0, 0.5]),
    st.sampled_from([0.1, 1.0]),
)


def _route(b, correct, on, tau_c):
    b.extras = {CORRECT: correct.double(), ON: on.double()}
    d = self_routing_rule(b, tau_c=tau_c)
    set_routes(b, d.routes)
    return d.routes


def _set_up(case, data, dp):
    b = case.batch
    B = b.num_seqs
    side = torch.zeros(B, dtype=torch.long)
    for r, ids in enumerate(split_sequences(B, dp)):
        side[ids] = r
    b.group_ids = b.group_ids * dp + side
    b.self_teacher_logprobs = b.teacher_logprobs
    correct = torch.tensor(data.draw(st.lists(st.sampled_from([True, True, False]), min_size=B, max_size=B)))
    on = torch.tensor(data.draw(st.lists(st.booleans(), min_size=B, max_size=B)))
    tau_c = data.draw(st.sampled_from([0.0, 0.0, 0.3, 1.0]))
    routes = _route(b, correct, on, tau_c)
    pad = unpack(b)
    want = rd.self_routing_routes(correct, pad.per_token["old_logprobs"], pad.loss_mask, b.group_ids, tau_c)
    assert torch.equal(routes, want)


def _reference(case):
    cfg = case.cfg
    args = dict(cfg.policy_loss_args)
    args.pop("aggregation")

    def fn(full, pad):
        logp, old, adv, mask = padded_inputs(full, pad)
        return rd.self_routing_loss(
            logp,
            old,
            adv,
            mask,
            pad.per_token["self_teacher_logprobs"],
            case.batch.extras[ON],
            case.batch.extras["routes"].long(),
            aggregation=cfg.aggregation,
            **args,
        )

    return reference_method_loss_and_grad(case, fn)


@settings(max_examples=10)
@given(
    case=rl_cases(torch.float64, cfgs=CFGS),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
    data=st.data(),
)
def test_matches_reference(case, tp, dp, mb, data):
    _set_up(case, data, dp)
    mb = min(mb, -(-case.batch.num_seqs // dp))
    assert_equivalent(megarl_method_loss_and_grad(case, tp, dp, mb), _reference(case), case.logits)


def _batch(correct, groups, lens=(3, 2, 4, 3, 2, 3), V=7, seed=0, tau_c=0.8, conf_shift=0.0):
    g = torch.Generator().manual_seed(seed)
    b = from_sequences(
        [[1]] * len(correct), [torch.randint(0, V, (n,), generator=g).tolist() for n in lens], groups
    )
    T = b.num_tokens
    logits = torch.randn(T, V, generator=g, dtype=torch.float64)
    b.old_logprobs = torch.log_softmax(logits, -1)[torch.arange(T), b.tokens] + conf_shift
    b.self_teacher_logprobs = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    b.advantages = torch.randn(T, generator=g, dtype=torch.float64) * b.loss_mask
    routes = _route(b, torch.tensor(correct), torch.ones(len(correct), dtype=torch.bool), tau_c)
    return b, logits, routes


def _loss_grad(b, logits, loss="self_routing", **args):
    obj = build_objective({"policy_loss": loss, "policy_loss_args": args})
    b = obj.prepare(b, None)
    logits = logits.clone().requires_grad_(True)
    out = obj(logits, b, LossContext(GlobalNormalisers.from_batch(b)))
    out.loss.backward()
    return out.loss.detach(), logits.grad


def test_all_mixed_groups_is_grpo_exactly():
    b, logits, routes = _batch([True, False, False, True, True, False], [0, 0, 1, 1, 2, 2])
    assert routes.tolist() == [0] * 6
    assert all(torch.equal(x, y) for x, y in zip(_loss_grad(b, logits), _loss_grad(b, logits, loss="ppo")))


def test_skipped_groups_have_zero_gradient_and_leave_the_others_alone():
    # group 2 all correct and confident (tau_c = 0): skipped
    b, logits, routes = _batch([True, False, False, False, True, True], [0, 0, 1, 1, 2, 2], tau_c=0.0)
    assert routes.tolist() == [0, 0, 1, 1, 3, 3]
    loss, grad = _loss_grad(b, logits)
    rows = torch.repeat_interleave(routes == 3, b.seq_lens)
    assert torch.all(grad[rows] == 0) and grad[~rows].abs().sum() > 0
    keep = [0, 1, 2, 3]
    sub = b.select(keep)
    sub_logits = logits[torch.repeat_interleave(~(routes == 3), b.seq_lens)]
    sub_loss, sub_grad = _loss_grad(sub, sub_logits)
    torch.testing.assert_close(loss, sub_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad[~rows], sub_grad, rtol=1e-12, atol=1e-14)


def test_regularise_only_when_confidence_is_below_tau():
    _, _, low = _batch([True] * 6, [0, 0, 1, 1, 2, 2], tau_c=1.0)
    _, _, high = _batch([True] * 6, [0, 0, 1, 1, 2, 2], tau_c=0.0)
    assert low.tolist() == [2] * 6 and high.tolist() == [3] * 6


@settings(max_examples=10)
@given(perm_seed=st.integers(0, 1000), correct=st.lists(st.booleans(), min_size=6, max_size=6))
def test_routes_do_not_depend_on_the_order_inside_a_group(perm_seed, correct):
    b, _, routes = _batch(correct, [0, 0, 0, 1, 1, 1], tau_c=0.3)
    g = torch.Generator().manual_seed(perm_seed)
    order = torch.cat([torch.randperm(3, generator=g), 3 + torch.randperm(3, generator=g)])
    p = b.select(order)
    assert torch.equal(self_routing_rule(p, tau_c=0.3).routes, routes[order])


def test_self_distillation_vanishes_when_the_teacher_is_the_student():
    b, logits, routes = _batch([False] * 6, [0, 0, 1, 1, 2, 2])
    assert routes.tolist() == [1] * 6
    b.old_logprobs = torch.log_softmax(logits, -1)[torch.arange(b.num_tokens), b.tokens]
    b.self_teacher_logprobs = b.old_logprobs.clone()
    loss, grad = _loss_grad(b, logits)
    assert float(loss) == 0.0 and torch.all(grad == 0)


def test_route_histogram_sums_to_the_groups():
    _, _, routes = _batch([True, False, False, False, True, True], [0, 0, 1, 1, 2, 2], tau_c=0.0)
    m = route_metrics(routes, torch.tensor([0, 0, 1, 1, 2, 2]), NAMES, "route")
    assert sum(m[f"route/{n}_groups"] for n in NAMES) == 3 and m["route/skip_groups"] == 1


def test_bad_input_is_named():
    b, logits, _ = _batch([True, False, False, False, True, True], [0, 0, 1, 1, 2, 2])
    with pytest.raises(ValueError, match=CORRECT):
        self_routing_rule(dataclasses.replace(b, extras={}))
    with pytest.raises(ValueError, match="tau_c"):
        self_routing_rule(b, tau_c=2.0)
    with pytest.raises(ValueError, match="self_teacher_logprobs"):
        _loss_grad(dataclasses.replace(b, self_teacher_logprobs=None), logits)
    with pytest.raises(ValueError, match="token-sum"):
        _loss_grad(b, logits, aggregation="token-sum")


def test_example_loads():
    cfg = load_example("self-routing")
    assert (
        cfg["objective"]["policy_loss"] == "self_routing"
        and cfg["inputs"]["routes"]["rule"] == "self_routing"
    )
