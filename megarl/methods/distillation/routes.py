"""Per-group routes: one route per prompt group (e.g. GRPO / distil / skip), shared by the group's
samples, each route with its own global normaliser.

A method decides the routes of its groups (``group_routes``: a rule applied to each group's
per-sample values), stores them per sequence in ``batch.extras['routes']`` and, once per optimizer
step on the data-parallel rank's whole batch (the objective part's ``prepare``), counts each
route's loss tokens, sequences and groups over every DP rank (``prepare_routes``). ``route_scale``
then turns a per-token loss that the objective aggregates with the global normaliser into the sum
over routes of each route's own aggregate:

    agg(scale * l) = sum_r agg_r(l restricted to route r)

where ``agg_r`` divides by route r's token count (token-mean) or sequence count (seq-mean-*), so
that micro-batching and data parallelism give exactly the whole batch's value. ``route_metrics``
reports the routes' group counts and fractions. The sequences that take part in a route may be a
subset of its groups' sequences (``active``: e.g. one target sample per group).

The ``routes`` batch input (stage ``batch``, every rank, after the learner passes) runs a rule
registered in ``ROUTE_RULES`` (``inputs.routes.rule``, with ``inputs.routes.args`` as its keyword
arguments): ``rule(batch, **args) -> RouteDecision``, sets the routes and reports their counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.objectives.api import GlobalNormalisers
from megarl.ops import comm
from megarl.ops.segments import _dense_groups, segment_sum
from megarl.plugin.inputs import InputProvider, RolloutInfo, register_provider
from megarl.plugin.knobs import Knobs, check_call_knobs
from megarl.plugin.spec import MethodParts
from megarl.registry import Registry

ROUTE = "routes"  # extras: [B] route index of each sequence (the same within a group)
ROUTE_COUNTS = "route_counts"  # extras: [B, 3R] global (tokens, sequences, groups) of every route
ACTIVE = "route_active"  # extras: [B] 1 where the sequence takes part in its route


def group_routes(
    group_ids: torch.Tensor, values: torch.Tensor, rule: Callable[[torch.Tensor], int]
) -> torch.Tensor:
    """[B] route of each sequence: ``rule(values of the group's sequences, in batch order)`` -> the
    group's route index, given to every sequence of the group. ``values``: [B] or [B, ...]."""
    inv, n = _dense_groups(group_ids)
    routes = torch.empty(group_ids.numel(), dtype=torch.long)
    order = torch.sort(inv, stable=True).indices  # each group's members in batch order
    bounds = torch.bincount(inv, minlength=n).cumsum(0).tolist()
    for g in range(n):
        members = order[(bounds[g - 1] if g else 0) : bounds[g]]
        r = int(rule(values[members]))
        if r < 0:
            raise ValueError(
                f"route rule returned {r} for group {int(group_ids[members[0]])}; routes are >= 0"
            )
        routes[members] = r
    return routes


def check_shared(routes: torch.Tensor, group_ids: torch.Tensor) -> None:
    """Raise naming the group when a group's sequences are on different routes."""
    inv, n = _dense_groups(group_ids)
    lo = torch.full((n,), torch.iinfo(torch.long).max).scatter_reduce(0, inv, routes, "amin")
    hi = torch.full((n,), -1).scatter_reduce(0, inv, routes, "amax")
    bad = (lo != hi).nonzero()
    if bad.numel():
        g = int(group_ids[(inv == int(bad[0])).nonzero()[0, 0]])
        raise ValueError(
            f"extras['{ROUTE}']: group {g} has sequences on routes {int(lo[bad[0]])} and {int(hi[bad[0]])}"
        )


def set_routes(batch: PackedBatch, routes: torch.Tensor, active: torch.Tensor | None = None) -> None:
    """Store ``routes`` [B] (checked shared per group) and ``active`` [B] (default: all) in
    ``batch.extras``."""
    if routes.shape != (batch.num_seqs,):
        raise ValueError(f"extras['{ROUTE}']: expected [{batch.num_seqs}] routes, got {tuple(routes.shape)}")
    check_shared(routes, batch.group_ids)
    batch.extras[ROUTE] = routes.to(torch.float64)
    on = torch.ones(batch.num_seqs) if active is None else active
    batch.extras[ACTIVE] = on.to(torch.float64)


def _routes(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    if ROUTE not in batch.extras:
        raise ValueError(f"the batch carries no extras['{ROUTE}'] (set by the method's route decision)")
    r = batch.extras[ROUTE].long()
    active = batch.extras.get(ACTIVE, torch.ones(batch.num_seqs, dtype=torch.float64))
    return r, active.bool()


def prepare_routes(batch: PackedBatch, num_routes: int, dp_group: Any = None) -> PackedBatch:
    """Count every route's active loss tokens, active sequences with a loss token, and groups in
    this rank's batch, sum them over ``dp_group`` and store the [3R] vector on every sequence
    (``extras['route_counts']``). Call once per optimizer step before micro-batching. A group
    lies on one DP rank (the trainer shares out whole groups)."""
    r, active = _routes(batch)
    if r.numel() and (int(r.min()) < 0 or int(r.max()) >= num_routes):
        raise ValueError(f"extras['{ROUTE}'] holds routes outside [0, {num_routes})")
    ntok = segment_sum(batch.loss_mask.double(), batch.cu_seqlens) * active
    counts = torch.zeros(3 * num_routes, dtype=torch.float64)
    counts[:num_routes].index_add_(0, r, ntok)
    counts[num_routes : 2 * num_routes].index_add_(0, r, (ntok > 0).double())
    inv, n = _dense_groups(batch.group_ids)
    group_route = torch.zeros(n, dtype=torch.long).index_copy(0, inv, r) if n else r[:0]
    counts[2 * num_routes :].index_add_(0, group_route, torch.ones(n, dtype=torch.float64))
    comm.all_reduce(counts, "sum", dp_group)
    batch.extras[ROUTE_COUNTS] = counts.expand(batch.num_seqs, -1).clone()
    return batch


def route_counts(batch: PackedBatch) -> torch.Tensor:
    """[3, R] global (tokens, sequences, groups) per route, as ``prepare_routes`` stored them."""
    c = batch.extras.get(ROUTE_COUNTS)
    if c is None:
        raise ValueError(f"the batch carries no extras['{ROUTE_COUNTS}'] (prepare_routes runs first)")
    if c.shape[0] == 0:
        return torch.zeros(3, c.shape[1] // 3, dtype=torch.float64)
    return c[0].view(3, -1)


def route_scale(batch: PackedBatch, norm: GlobalNormalisers, mode: str) -> torch.Tensor:
    """[T] factor per token: (the global normaliser of ``mode``) / (its route's), 0 on inactive
    sequences and on routes with nothing to normalise; with it, ``aggregate(scale * l, mode)`` is
    the sum over routes of each route's own aggregate (see the module docstring)."""
    r, active = _routes(batch)
    counts = route_counts(batch)
    if mode == "token-sum":
        per_route = torch.ones(counts.shape[1], dtype=torch.float64)
    elif mode == "token-mean":
        per_route = max(norm.num_tokens, 1.0) / counts[0].clamp(min=1.0)
    elif mode.startswith("seq-mean"):
        per_route = max(norm.num_seqs, 1.0) / counts[1].clamp(min=1.0)
    else:
        raise KeyError(f"route_scale: unknown aggregation {mode!r}")
    per_seq = per_route[r] * active.double()
    return per_seq.repeat_interleave(batch.seq_lens)


def route_metrics(
    routes: torch.Tensor, group_ids: torch.Tensor, names: Sequence[str], prefix: str
) -> dict[str, float]:
    """``<prefix>/<name>_groups`` (count) and ``<prefix>/<name>_frac`` (of the batch's groups) per route."""
    inv, n = _dense_groups(group_ids)
    per_group = torch.zeros(n, dtype=torch.long).index_copy(0, inv, routes) if n else routes[:0]
    out: dict[str, float] = {}
    for i, name in enumerate(names):
        k = int((per_group == i).sum())
        out[f"{prefix}/{name}_groups"] = float(k)
        out[f"{prefix}/{name}_frac"] = k / max(n, 1)
    return out


@dataclass
class RouteDecision:
    """A rule's answer: ``routes`` [B] (shared per group), the routes' ``names`` (index = route),
    and ``active`` [B] (None: every sequence of a route takes part)."""

    routes: torch.Tensor
    names: tuple[str, ...]
    active: torch.Tensor | None = None


ROUTE_RULES: Registry = Registry("route rule")
"""name -> ``rule(batch, **args) -> RouteDecision``; methods register theirs."""


@dataclass
class RouteKnobs(Knobs):
    """rule: a name in ``ROUTE_RULES``; args: its keyword arguments."""

    rule: str = ""
    args: dict = field(default_factory=dict)

    def check(self) -> None:
        """A registered rule whose keywords include every key of ``args``."""
        fn = ROUTE_RULES.get(self.rule) if self.rule else None
        if fn is None:
            raise ValueError("rule is required (a registered route rule)")
        check_call_knobs(fn, self.args, "inputs.routes.args", f"route rule {self.rule}", skip=("batch",))


class RouteFiller:
    """The ``routes`` batch input: the configured rule's routes in ``batch.extras``; counts as metrics."""

    def __init__(self, knobs: RouteKnobs):
        self.knobs = knobs

    def fill(self, batch: PackedBatch, info: RolloutInfo) -> dict[str, float]:
        """In place (every rank, deterministic)."""
        d = ROUTE_RULES.get(self.knobs.rule)(batch, **self.knobs.args)
        set_routes(batch, d.routes, d.active)
        return route_metrics(d.routes, batch.group_ids, d.names, "route")


ROUTES = register_provider(
    InputProvider(
        (ROUTE,),
        "batch",
        lambda ctx, names: RouteFiller(ctx.knobs),
        knobs=RouteKnobs,
        summary="one route per prompt group from a registered rule (inputs.routes.rule); counts as metrics",
    )
)


# the aggregation modes a per-route normaliser supports
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def route_aggregation_check(default: str):
    """A method ``build`` that refuses ``objective.policy_loss_args.aggregation`` (``default`` when
    unset) differing from ``objective.aggregation``: each route is normalised the objective's way."""

    def build(ctx, knobs) -> MethodParts:
        o = ctx.cfg.objective
        mine = dict(o.policy_loss_args).get("aggregation", default)
        if mine != o.aggregation:
            raise ValueError(
                f"objective.policy_loss_args.aggregation={mine!r} must equal objective.aggregation="
                f"{o.aggregation!r} (each route is normalised the objective's way)"
            )
        return MethodParts()

    return build
