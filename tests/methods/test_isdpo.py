"""I-SDPO: megarl (routes prepared per DP shard, TP 1/2, DP 1/2, micro-batched) equals
reference/self_distillation.py:isdpo_loss in loss and gradient; the spec's invariants: groups with
a success give exactly the GRPO loss and gradient, all-correct groups give zero gradient, the
distil-route frequency over Bernoulli(p) groups is (1-p)^G, the distillation term vanishes when the
teacher equals the student, no gradient reaches the teacher."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.self_distillation as ref
from megarl.batch import from_sequences
from megarl.methods.distillation.isdpo import SPEC, build, isdpo_rule
from megarl.methods.distillation.routes import set_routes
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
    lambda agg, coef: ObjectiveConfig(
        policy_loss="isdpo", aggregation=agg, policy_loss_args={"aggregation": agg, "sd_coef": coef}
    ),
    st.sampled_from(AGGS),
    st.sampled_from([1.0, 0.5]),
)


def _set_up(case, data, dp):
    """Correctness bits (some groups all wrong), the self-teacher's logprobs and which sequences it
    scored, routes from the rule; groups never straddle the DP split."""
    b = case.batch
    side = torch.zeros(b.num_seqs, dtype=torch.long)
    for r, ids in enumerate(split_sequences(b.num_seqs, dp)):
        side[ids] = r
    b.group_ids = b.group_ids * dp + side
    correct = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b.num_seqs, max_size=b.num_seqs)))
    on = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b.num_seqs, max_size=b.num_seqs)))
    b.self_teacher_logprobs = b.teacher_logprobs
    b.extras = {"self_teacher_correct": correct.double(), "self_teacher_on": on.double()}
    set_routes(b, isdpo_rule(b).routes)
    return correct, on


def _reference(case, correct, on):
    args = case.cfg.policy_loss_args

    def fn(full, pad):
        _, old, adv, mask = padded_inputs(full, pad)
        return ref.isdpo_loss(
            full,
            pad.tokens,
            mask,
            adv,
            old,
            pad.per_token["self_teacher_logprobs"],
            on,
            correct,
            pad.per_seq["group_ids"],
            sd_coef=args["sd_coef"],
            aggregation=args["aggregation"],
        )

    return reference_method_loss_and_grad(case, fn)


@settings(max_examples=5, deadline=None)
@given(
    case=rl_cases(torch.float64, cfgs=CFGS),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
    data=st.data(),
)
def test_matches_reference(case, tp, dp, mb, data):
    correct, on = _set_up(case, data, dp)
    assert_equivalent(
        megarl_method_loss_and_grad(case, tp, dp, mb), _reference(case, correct, on), case.logits
    )


def _loss_and_grad(b, logits, cfg):
    obj = build_objective(cfg)
    b = obj.prepare(b)
    x = logits.clone().requires_grad_(True)
    out = obj(x, b, LossContext(GlobalNormalisers.from_batch(b)))
    out.loss.backward()
    return out.loss.detach(), x.grad


def _batch(correct, gids, seed=0, V=7):
    g = torch.Generator().manual_seed(seed)
    n = len(correct)
    b = from_sequences(
        [[1, 2]] * n, [[3, 4, 5][: 1 + i % 3] for i in range(n)], gids, rewards=[float(c) for c in correct]
    )
    logits = torch.randn(b.num_tokens, V, generator=g, dtype=torch.float64)
    logp = torch.log_softmax(logits, -1)[torch.arange(b.num_tokens), b.tokens]
    b.old_logprobs = (logp - 0.3 * torch.rand(b.num_tokens, generator=g, dtype=torch.float64)).clamp(max=0)
    b.self_teacher_logprobs = (logp - torch.rand(b.num_tokens, generator=g, dtype=torch.float64)).clamp(max=0)
    from megarl.advantages.estimators import grpo, per_token

    b.advantages = per_token(b, grpo(b.rewards, b.group_ids))
    b.extras = {
        "self_teacher_correct": torch.tensor(correct).double(),
        "self_teacher_on": torch.ones(n, dtype=torch.float64),
    }
    set_routes(b, isdpo_rule(b).routes)
    return b, logits


@pytest.mark.parametrize("agg", AGGS)
def test_groups_with_a_success_give_exactly_grpo_and_all_correct_give_zero_gradient(agg):
    b, logits = _batch([True, False, False, True, True, False], [0, 0, 0, 1, 1, 1])
    mine = _loss_and_grad(
        b, logits, ObjectiveConfig("isdpo", aggregation=agg, policy_loss_args={"aggregation": agg})
    )
    grpo = _loss_and_grad(b, logits, ObjectiveConfig("ppo", aggregation=agg))
    assert torch.equal(mine[0], grpo[0]) and torch.equal(mine[1], grpo[1])
    b, logits = _batch([True] * 3, [0, 0, 0], seed=1)
    _, grad = _loss_and_grad(
        b, logits, ObjectiveConfig("isdpo", aggregation=agg, policy_loss_args={"aggregation": agg})
    )
    assert bool((grad == 0).all())


def test_distil_route_frequency_is_one_minus_p_to_the_g():
    g = torch.Generator().manual_seed(0)
    groups, G = 4000, 4
    for p in (0.2, 0.5):
        correct = torch.rand(groups * G, generator=g) < p
        b = from_sequences(
            [[1]] * (groups * G), [[2]] * (groups * G), torch.arange(groups).repeat_interleave(G).tolist()
        )
        b.extras = {"self_teacher_correct": correct.double()}
        freq = float(isdpo_rule(b).routes.double().mean())
        want = (1 - p) ** G
        assert abs(freq - want) < 4 * (want * (1 - want) / groups) ** 0.5, (p, freq, want)


def test_distillation_vanishes_when_the_teacher_is_the_student_and_never_reaches_the_teacher():
    b, logits = _batch([False] * 4, [0, 0, 1, 1])
    cfg = ObjectiveConfig("isdpo", policy_loss_args={"sd_coef": 1.0})
    b.old_logprobs = torch.log_softmax(logits, -1)[torch.arange(b.num_tokens), b.tokens]  # on-policy
    b.self_teacher_logprobs = b.old_logprobs.clone()
    loss, grad = _loss_and_grad(b, logits, cfg)
    assert float(loss) == 0.0 and bool((grad == 0).all())
    b.self_teacher_logprobs = (b.old_logprobs - 0.5).requires_grad_(True)
    loss, grad = _loss_and_grad(b, logits, cfg)
    assert float(loss) > 0 and bool(grad.abs().sum() > 0)
    assert b.self_teacher_logprobs.grad is None


def test_spec_example_and_mismatched_aggregation_is_refused():
    cfg = load_example("isdpo")
    assert cfg["method"]["name"] == "isdpo" and SPEC.config["inputs"]["routes"]["rule"] == "isdpo"

    class Ctx:
        class cfg:
            objective = ObjectiveConfig("isdpo", aggregation="seq-mean-token-mean", policy_loss_args={})

    with pytest.raises(ValueError, match=r"objective.policy_loss_args.aggregation='token-mean' must equal"):
        build(Ctx, None)
    b, _ = _batch([False, False], [0, 0])
    del b.extras["self_teacher_correct"]
    with pytest.raises(ValueError, match="self_teacher_correct"):
        isdpo_rule(b)


def test_vocab_term_without_a_read_sequence_needs_no_teacher_logits():
    """A batch where the self-teacher read no sequence has no privileged forward (no logits):
    isdpo_kl gives zero there; with a read distil-route sequence and no logits it refuses, naming
    the input."""
    reg = {"name": "isdpo_kl", "coef": 1.0, "aggregation": "token-mean"}
    cfg = ObjectiveConfig(
        "isdpo", aggregation="token-mean", policy_loss_args={"sd_coef": 0.0}, regularisers=[reg]
    )
    for read in (0.0, 1.0):
        b, logits = _batch([False, False, True, False], [0, 0, 1, 1])  # group 0 all wrong: distil
        b.extras["self_teacher_on"] = torch.full((b.num_seqs,), read, dtype=torch.float64)
        obj = build_objective(cfg)
        b = obj.prepare(b)
        x = logits.clone().requires_grad_(True)
        if read:
            with pytest.raises(ValueError, match="self_teacher_logits"):
                obj(x, b, LossContext(GlobalNormalisers.from_batch(b)))
            continue
        out = obj(x, b, LossContext(GlobalNormalisers.from_batch(b)))
        out.loss.backward()
        assert float(out.metrics["reg/isdpo_kl"]) == 0.0 and x.grad is not None


FULL = st.builds(
    lambda agg, coef: ObjectiveConfig(
        policy_loss="isdpo",
        aggregation=agg,
        policy_loss_args={"aggregation": agg, "sd_coef": 0.0},
        regularisers=[{"name": "isdpo_kl", "coef": coef, "aggregation": agg}],
    ),
    st.sampled_from(AGGS),
    st.sampled_from([1.0, 0.5]),
)


@settings(max_examples=4, deadline=None)
@given(
    case=rl_cases(torch.float64, cfgs=FULL),
    layout=st.sampled_from([(1, 1, 1), (2, 2, 2), (2, 1, 3)]),
    data=st.data(),
)
def test_full_vocabulary_distillation_matches_reference(case, layout, data):
    tp, dp, mb = layout
    correct, on = _set_up(case, data, dp)
    b = case.batch  # even groups all wrong (distil), every other sequence unread by the self-teacher
    correct = correct & (b.group_ids % 2 == 1)
    on = torch.arange(b.num_seqs) % 2 == 0
    b.extras.update(self_teacher_correct=correct.double(), self_teacher_on=on.double())
    set_routes(b, isdpo_rule(b).routes)
    coef = case.cfg.regularisers[0]["coef"]

    def fn(full, pad):
        _, old, adv, mask = padded_inputs(full, pad)
        teacher = torch.zeros_like(full, requires_grad=False)
        teacher[pad.attention_mask] = case.teacher_logits
        return ref.isdpo_loss(
            full,
            pad.tokens,
            mask,
            adv,
            old,
            pad.per_token["self_teacher_logprobs"],
            on,
            correct,
            pad.per_seq["group_ids"],
            sd_coef=coef,
            aggregation=case.cfg.aggregation,
            teacher_logits=teacher,
        )

    assert_equivalent(
        megarl_method_loss_and_grad(case, tp, dp, mb), reference_method_loss_and_grad(case, fn), case.logits
    )
