"""Prefix-then-continue rounds (megarl/trainer/prefix_rounds.py) with the real embedded engine on a
tiny random model and the run's reward computer: the kept samples continue their prefixes exactly
(same tokens, same logprobs), groups hold only the kept samples with the allocator's extras, the
step repeats itself, its token counters add up, and the batch gets PAIR's advantages."""

import asyncio

import pytest
import torch

from megarl.advantages.estimators import compute_advantages
from megarl.methods.allocation.pair import PI, SIZE, PAIRAllocator, PAIRKnobs
from megarl.plugin.allocation import Continuation, PrefixView
from megarl.trainer.collector import RolloutCollector
from megarl.trainer.rollouts import build_batch, rollouts_from_groups
from tests.trainer.test_streaming_allocation import N, parts  # noqa: F401 (the module fixture)


class KeepSome:
    """Keeps samples whose index is not 1 (prompt slot 2: only sample 0, so the prompt is dropped);
    extra ``w`` = the sample's index."""

    want, prefix_tokens = 4, 1

    def __init__(self):
        self.seen: list = []

    def choose(self, step: int, view: PrefixView) -> Continuation:
        keep = tuple(j == 0 if view.slot == 2 else j != 1 for j in range(view.n))
        return Continuation(keep, {"w": tuple(float(j) for j in range(view.n))})

    def end_step(self, step, prompts):
        self.seen = prompts
        return {"keep_some/steps": 1.0}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def collector(parts, allocator, processors=()) -> RolloutCollector:  # noqa: F811
    from megarl.data.dataset import PromptSampler
    from megarl.rollout.workflow import SingleTurn, WorkflowContext

    cfg, run, engine, ds, rewards = parts
    return RolloutCollector(
        engine=engine,
        tokenizer=run.tok,
        dataset=ds,
        sampler=PromptSampler(len(ds.rows), 0),
        rewards=rewards,
        workflow=SingleTurn(WorkflowContext(run.tok, lambda t, a: (0.0, False), None, cfg.environment)),
        processors=list(processors),
        allocator=allocator,
        sampling=run.sampling_params,
        n=N,
        weights={"low": 1.0},
        fallback=0.0,
        version=lambda: 0,
    )


def collect(c, step):
    return asyncio.new_event_loop().run_until_complete(c.collect(step))


def test_kept_samples_continue_their_prefixes_and_groups_hold_only_them(parts):  # noqa: F811
    alloc = KeepSome()
    c = collector(parts, alloc)
    b = collect(c, 1)
    views = {v.slot: (v, d, r, L) for v, d, r, L in alloc.seen}
    assert c.sampler.cursor == 4 and sorted(views) == [0, 1, 2, 3]
    assert [g.index for g in b.groups] == [0, 1, 3]  # slot 2 kept one sample: dropped
    assert views[2][2] == () and views[2][3] == ()
    cont = 0
    for g in b.groups:
        view, _, rewards, lengths = views[g.index]
        kept = [j for j in range(N) if j != 1]
        assert len(g.samples) == len(kept) and g.extras["w"] == [float(j) for j in kept]
        assert tuple(g.rewards) == rewards and tuple(len(s.token_ids) for s in g.samples) == lengths
        for j, s in zip(kept, g.samples):
            pre, lp = view.prefixes[j], view.logprobs[j]
            assert tuple(s.token_ids[: len(pre)]) == pre and tuple(s.logprobs[: len(pre)]) == lp
            if not view.finished[j]:
                cont += len(s.token_ids) - len(pre)
    st = b.stats
    pre_tokens = sum(len(p) for v, *_ in alloc.seen for p in v.prefixes)
    assert (
        st["method"]["alloc/prefix_tokens"] == pre_tokens
        and st["method"]["alloc/continuation_tokens"] == cont
    )
    assert st["budget_tokens"] == pre_tokens + cont and st["budget_samples"] == 4 * N
    assert cont > 0  # some prefixes were continued
    again = collect(collector(parts, KeepSome()), 1)
    assert [[s.token_ids for s in g.samples] for g in again.groups] == [
        [s.token_ids for s in g.samples] for g in b.groups
    ]


def test_pair_step_gives_a_batch_with_its_advantages(parts):  # noqa: F811
    alloc = PAIRAllocator(PAIRKnobs(prefix_tokens=1, budget_frac=0.5), want=5, seed=5)
    b = collect(collector(parts, alloc), 2)
    assert b.groups and all(2 <= len(g.samples) <= N for g in b.groups)
    ro = rollouts_from_groups(b.groups, {"reverse": 0}, ["low"], False)
    batch = build_batch(ro, 2)
    for k, v in ro.extras.items():
        batch.extras[k] = torch.as_tensor(v, dtype=torch.float64)
    adv = compute_advantages(batch, "pair_ht")
    assert batch.extras[PI].min() > 0 and set(batch.extras[SIZE].tolist()) == {float(N)}
    assert torch.isfinite(adv).all()
    assert b.stats["method"]["pair/prompts_known"] == len(alloc.history) > 0


def test_round_processors_are_refused(parts):  # noqa: F811
    from megarl.trainer.prefix_rounds import PrefixScheduler

    with pytest.raises(ValueError, match="round processors .* need groups of rollout.n samples"):
        PrefixScheduler(collector(parts, KeepSome(), processors=[object()]), KeepSome())
