"""Per-group routes: one route per group, each route normalised by its own global counts, exact
under data-parallel splits and micro-batching; the routes batch input runs a registered rule and
reports the route counts; bad routes and knobs are refused naming the field."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.methods.distillation.routes import (
    ROUTE_RULES,
    RouteDecision,
    RouteFiller,
    RouteKnobs,
    check_shared,
    group_routes,
    prepare_routes,
    route_counts,
    route_metrics,
    route_scale,
    set_routes,
)
from megarl.objectives.aggregation import aggregate
from megarl.objectives.api import GlobalNormalisers
from megarl.plugin.inputs import RolloutInfo
from megarl.plugin.knobs import build_knobs
from megarl.testing.equivalence import split_sequences
from megarl.testing.simulated_group import SimulatedWorld
from tests.property.test_advantages import reward_batches

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum")


def _reference(b, loss, routes, active, mode, R):
    """sum_r (route r's aggregate over its own active sequences), written directly."""
    total = torch.zeros((), dtype=torch.float64)
    cu = b.cu_seqlens.tolist()
    for r in range(R):
        ids = [i for i in range(b.num_seqs) if routes[i] == r and active[i]]
        rows = [(loss[cu[i] : cu[i + 1]], b.loss_mask[cu[i] : cu[i + 1]]) for i in ids]
        rows = [(x, m) for x, m in rows if m.sum() > 0]
        if not rows:
            continue
        if mode == "token-mean":
            total += sum((x * m).sum() for x, m in rows) / sum(m.sum() for _, m in rows)
        elif mode == "seq-mean-token-mean":
            total += sum((x * m).sum() / m.sum() for x, m in rows) / len(rows)
        elif mode == "seq-mean-token-sum":
            total += sum((x * m).sum() for x, m in rows) / len(rows)
        else:
            total += sum((x * m).sum() for x, m in rows)
    return total


@settings(max_examples=12, deadline=None)
@given(reward_batches(), st.integers(0, 2**31 - 1), st.sampled_from(MODES), st.sampled_from([1, 2]))
def test_route_aggregates_are_exact_over_dp_and_micro_batches(b, seed, mode, dp):
    rng = torch.Generator().manual_seed(seed)
    R = 3
    per_group = torch.randint(0, R, (int(b.group_ids.max()) + 1,), generator=rng)
    routes = per_group[b.group_ids]
    active = torch.rand(b.num_seqs, generator=rng) < 0.7
    loss = torch.randn(b.num_tokens, generator=rng, dtype=torch.float64)
    set_routes(b, routes, active)
    want = _reference(b, loss, routes, active, mode, R)
    # DP shares of whole groups (the batch's groups are contiguous), then micro-batches
    shards = split_sequences(b.num_seqs, dp)
    while dp > 1 and len(shards) > 1 and b.group_ids[shards[0][-1]] == b.group_ids[shards[1][0]]:
        shards = [shards[0] + shards[1][:1], shards[1][1:]]
        shards = [s for s in shards if s]
    world = SimulatedWorld(len(shards))

    def rank(r, g):
        local = b.select(shards[r])
        norms = GlobalNormalisers.from_batch(local, g)
        local = prepare_routes(local, R, g)
        out = torch.zeros((), dtype=torch.float64)
        for ids in split_sequences(local.num_seqs, 2):
            mb = local.select(ids)
            x = loss[
                torch.cat(
                    [
                        torch.arange(int(b.cu_seqlens[shards[r][i]]), int(b.cu_seqlens[shards[r][i] + 1]))
                        for i in ids
                    ]
                )
            ]
            out += aggregate(x * route_scale(mb, norms, mode), mb.loss_mask, mb.cu_seqlens, mode, norms)
        return out

    got = sum(world.run(rank))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    counts = route_counts(prepare_routes(b, R))
    for r in range(R):
        on = (routes == r) & active
        ntok = b.response_lens()[on]
        assert counts[0, r] == float(ntok.sum()) and counts[1, r] == float((ntok > 0).sum())
        assert counts[2, r] == float((per_group[torch.unique(b.group_ids)] == r).sum())


def test_group_routes_share_a_route_and_metrics_count_groups():
    gids = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    correct = torch.tensor([0.0, 0, 0, 1, 0, 1, 1])
    routes = group_routes(gids, correct, lambda c: int(c.sum() == 0))
    assert routes.tolist() == [1, 1, 1, 0, 0, 0, 0]
    m = route_metrics(routes, gids, ("grpo", "distil"), "route")
    assert m == {
        "route/grpo_groups": 2.0,
        "route/grpo_frac": 2 / 3,
        "route/distil_groups": 1.0,
        "route/distil_frac": 1 / 3,
    }
    with pytest.raises(ValueError, match=r"extras\['routes'\]: group 1 has sequences on routes 0 and 1"):
        check_shared(torch.tensor([1, 1, 1, 0, 1, 0, 0]), gids)
    with pytest.raises(ValueError, match="routes are >= 0"):
        group_routes(gids, correct, lambda c: -1)


def test_routes_input_runs_a_registered_rule_and_refuses_bad_knobs():
    from megarl.batch import from_sequences

    @ROUTE_RULES.register("test_low_reward_skips")
    def rule(batch, below: float = 0.5):
        r = group_routes(batch.group_ids, batch.rewards, lambda x: int(bool((x < below).all())))
        return RouteDecision(r, ("train", "skip"))

    b = from_sequences(
        [[1], [1], [1], [1]], [[2, 3], [4], [5], [6, 7]], [0, 0, 1, 1], rewards=[0.0, 0.2, 1.0, 0.0]
    )
    knobs = build_knobs(
        RouteKnobs, {"rule": "test_low_reward_skips", "args": {"below": 0.5}}, "inputs.routes"
    )
    m = RouteFiller(knobs).fill(b, RolloutInfo([""] * 4, {}))
    assert b.extras["routes"].tolist() == [1.0, 1.0, 0.0, 0.0] and m["route/skip_groups"] == 1.0
    with pytest.raises(ValueError, match=r"inputs.routes.args.above"):
        build_knobs(RouteKnobs, {"rule": "test_low_reward_skips", "args": {"above": 1}}, "inputs.routes")
    with pytest.raises(ValueError, match="inputs.routes: rule is required"):
        build_knobs(RouteKnobs, {}, "inputs.routes")
    with pytest.raises(KeyError, match="unknown route rule 'nope'"):
        build_knobs(RouteKnobs, {"rule": "nope"}, "inputs.routes")
    with pytest.raises(ValueError, match="prepare_routes runs first"):
        route_scale(b, GlobalNormalisers(1.0, 1.0), "token-mean")
