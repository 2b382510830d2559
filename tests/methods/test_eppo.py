"""EPPO: megarl (stateful per-task entropy EMA, prepared on every DP rank) equals
reference/trust_regions.py:eppo_update/eppo_task_scales/eppo over several steps (loss, gradient and
state; TP 1/2, DP 1/2, micro-batches), survives checkpoint/resume, and satisfies the method's
invariants."""

import dataclasses
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.batch import from_sequences, unpack
from megarl.methods.trust_regions.eppo import EppoState
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective, resolved_clip
from megarl.testing.equivalence import megarl_loss_and_grad
from reference import trust_regions as ref
from tests.methods.trust_regions_harness import (
    aggregate,
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    prepare_on_dp_ranks,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases

K = 3
ARGS = st.fixed_dictionaries(
    {
        "num_tasks": st.just(K),
        "kappa": st.sampled_from([0.5, 1.0, 2.0]),
        "h_ref": st.sampled_from(["mean", "initial"]),
        "adapt_low": st.booleans(),
        "momentum": st.sampled_from([0.9, 0.5]),
    }
)
CFGS = st.builds(
    ObjectiveConfig,
    policy_loss=st.just("eppo"),
    policy_loss_args=ARGS,
    dual_clip=st.sampled_from([None, 3.0]),
    aggregation=st.sampled_from(["token-mean", "seq-mean-token-mean"]),
)


def _with_tasks(case, data, task_ids=None):
    b = case.batch
    b.task_ids = torch.tensor(
        task_ids
        if task_ids is not None
        else data.draw(st.lists(st.integers(-1, K - 1), min_size=b.num_seqs, max_size=b.num_seqs))
    )
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000)))
    b.entropies = torch.rand(b.num_tokens, generator=g, dtype=torch.float64) * 3
    return case


def _reference_step(case, st_ref):
    """One reference step: update the statistics, then the loss with the new task scales."""
    cfg, a = case.cfg, case.cfg.policy_loss_args
    pad = unpack(case.batch)
    ema, seen, initial = ref.eppo_update(
        *st_ref, pad.per_seq["task_ids"], pad.per_token["entropies"], pad.loss_mask, a["momentum"]
    )
    scales = ref.eppo_task_scales(ema, seen, initial, a["kappa"], h_ref=a["h_ref"])

    def fn(full, pad):
        logp, old, adv, _ = padded_inputs(full, pad)
        return aggregate(
            ref.eppo(
                logp,
                old,
                adv,
                pad.per_seq["task_ids"],
                scales,
                resolved_clip(cfg)["clip_low"],
                resolved_clip(cfg)["clip_high"],
                a["adapt_low"],
                resolved_clip(cfg)["dual_clip"],
            ),
            pad,
            cfg.aggregation,
        )

    return reference_method_loss_and_grad(case, fn), (ema, seen, initial)


def _fresh():
    return (
        torch.zeros(K, dtype=torch.float64),
        torch.zeros(K, dtype=torch.bool),
        torch.zeros(K, dtype=torch.float64),
    )


@settings(max_examples=10)
@given(
    case=rl_cases(torch.float64, cfgs=CFGS),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
    data=st.data(),
)
def test_matches_reference_over_steps(case, tp, dp, mb, data):
    objectives, st_ref = None, _fresh()
    for _ in range(2):  # two steps on the same structure, fresh task ids and entropies
        case = _with_tasks(case, data)
        prepared, objectives = prepare_on_dp_ranks(case, dp, objectives)
        got = megarl_loss_and_grad(prepared, tp=tp, dp=dp, micro_batches=mb, objective=objectives[0])
        want, st_ref = _reference_step(case, st_ref)
        assert_equivalent(got, want, case.logits)
        for o in objectives:  # every DP rank holds the same, reference state
            sd = o.state_dict()["policy_loss"]
            torch.testing.assert_close(sd["ema"], st_ref[0], rtol=1e-12, atol=1e-14)
            assert torch.equal(sd["seen"], st_ref[1])


@settings(max_examples=5)
@given(case=rl_cases(torch.float64, cfgs=CFGS), data=st.data())
def test_equal_task_entropies_and_missing_task_ids_give_fixed_clipping(case, data):
    plain = dataclasses.replace(case.cfg, policy_loss="ppo", policy_loss_args={})
    want = megarl_loss_and_grad(dataclasses.replace(case, cfg=plain), tp=2, micro_batches=2)
    case = _with_tasks(case, data)
    case.batch.entropies = torch.full_like(case.batch.entropies, 1.3)  # every task's mean entropy is 1.3
    assert_equivalent(
        megarl_method_loss_and_grad(case, tp=2, micro_batches=2), want, case.logits, 1e-12, 1e-14
    )
    case.batch.task_ids = None
    case.batch.entropies = torch.rand_like(case.batch.entropies)
    assert_equivalent(
        megarl_method_loss_and_grad(case, tp=2, micro_batches=2), want, case.logits, 1e-12, 1e-14
    )


@given(h=st.lists(st.floats(0.01, 5), min_size=2, max_size=6), kappa=st.sampled_from([0.5, 1.0, 2.0]))
def test_bound_monotone_in_task_entropy_and_within_limits(h, kappa):
    s = EppoState(len(h))
    s.update(torch.tensor(h, dtype=torch.float64), torch.ones(len(h), dtype=torch.float64), 0.9)
    c = s.scales(kappa, 0.5, 2.0, "mean")
    order = torch.argsort(torch.tensor(h))
    # monotone up to rounding: entropies 1 ulp apart may give scales 1 ulp out of order
    assert torch.all(c[order][1:] >= c[order][:-1] - 1e-12) and torch.all((c >= 0.5) & (c <= 2.0))
    seen = torch.ones(len(h), dtype=torch.bool)
    torch.testing.assert_close(c, ref.eppo_task_scales(s.ema, seen, s.initial, kappa))


def test_single_task_mean_reference_is_fixed_and_initial_reference_adapts():
    s = EppoState(1)
    for h in (2.0, 1.0, 0.5):
        s.update(torch.tensor([h], dtype=torch.float64), torch.ones(1, dtype=torch.float64), 0.5)
    assert float(s.scales(1.0, 0.5, 2.0, "mean")) == 1.0
    assert float(s.scales(1.0, 0.5, 2.0, "initial")) == pytest.approx(
        (0.25 * 2.0 + 0.25 * 1.0 + 0.5 * 0.5) / 2.0
    )


def _batch(task_ids, entropies):
    b = from_sequences(
        [[1]] * len(task_ids), [[2, 3]] * len(task_ids), list(range(len(task_ids))), task_ids=task_ids
    )
    b.entropies = torch.tensor([x for h in entropies for x in (0.0, h, h)], dtype=torch.float64)
    b.advantages = torch.ones(b.num_tokens, dtype=torch.float64) * b.loss_mask
    return b


def test_state_survives_checkpoint_and_resume():
    cfg = {"policy_loss": "eppo", "policy_loss_args": {"num_tasks": 2}}
    steps = [
        _batch([0, 1, 1], [0.5, 2.0, 1.0]),
        _batch([1, 0, 0], [1.0, 0.2, 0.4]),
        _batch([0, 1, 0], [0.9, 3.0, 0.1]),
    ]
    straight = build_objective(cfg)
    outs = [straight.prepare(b, None).extras["eppo_scale"] for b in steps]
    first = build_objective(cfg)
    first.prepare(steps[0], None)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = build_objective(cfg)
    resumed.load_state_dict(torch.load(buf))
    for b, want in zip(steps[1:], outs[1:]):
        assert torch.equal(resumed.prepare(b, None).extras["eppo_scale"], want)
    assert not torch.equal(outs[1], build_objective(cfg).prepare(steps[1], None).extras["eppo_scale"])
    with pytest.raises(ValueError, match="num_tasks=3"):
        build_objective({"policy_loss": "eppo", "policy_loss_args": {"num_tasks": 3}}).load_state_dict(
            straight.state_dict()
        )


def test_bad_inputs_are_named():
    obj = build_objective({"policy_loss": "eppo", "policy_loss_args": {"num_tasks": 2}})
    with pytest.raises(ValueError, match=r"task_ids\[1\]=2"):
        obj.prepare(_batch([0, 2], [1.0, 1.0]), None)
    with pytest.raises(ValueError, match="entropies"):
        obj.prepare(dataclasses.replace(_batch([0, 1], [1.0, 1.0]), entropies=None), None)
    with pytest.raises(ValueError, match="momentun"):
        build_objective({"policy_loss": "eppo", "policy_loss_args": {"momentun": 0.5}}).prepare(
            _batch([0], [1.0]), None
        )


def test_ema_keeps_the_momentum_share_on_the_past():
    """H̄_k ← m·H̄_k + (1 − m)·μ_k with m = 0.9: the old mean keeps 90 %, a task's first batch
    sets it; an asymmetric momentum, so swapping m and 1 − m cannot pass."""
    s = EppoState(3)
    s.update(torch.tensor([4.0, 0.0, 0.0], dtype=torch.float64), torch.tensor([2.0, 0.0, 0.0]), 0.9)
    s.update(torch.tensor([3.0, 8.0, 0.0], dtype=torch.float64), torch.tensor([3.0, 2.0, 0.0]), 0.9)
    torch.testing.assert_close(s.ema, torch.tensor([0.9 * 2.0 + 0.1 * 1.0, 4.0, 0.0], dtype=torch.float64))
    assert s.initial.tolist() == [2.0, 4.0, 0.0] and s.seen.tolist() == [True, True, False] and s.updates == 2
