"""The streaming scheduler (megarl/trainer/streaming.py) with the real embedded engine on a tiny
random model, the run's reward computer and prompt sampler: it ends a step exactly as
reference/allocation.py ``simulate_step`` does on the outcomes it saw (whatever order the requests
landed in), stays within its budget, aborts the requests of abandoned prompts on the engine, repeats
itself from the same sampler position, and counts the budget metrics."""

import asyncio

import pytest
import torch

from megarl.data.dataset import PromptDataset, PromptRow, PromptSampler
from megarl.data.tokenizer import CharTokenizer
from megarl.methods.allocation.sara import SARAAllocator, SARAKnobs
from megarl.plugin.allocation import ABANDON, PromptView, StepBudget
from megarl.rewards.compute import RewardComputer
from megarl.rollout.embedded import EmbeddedEngine, hf_model_from_config
from megarl.rollout.workflow import SingleTurn, WorkflowContext
from megarl.testing.tiny_qwen3 import TINY_QWEN3_HF
from megarl.trainer.collector import RolloutCollector
from megarl.trainer.config import from_dict
from megarl.trainer.run import Run
from megarl.trainer.step_metrics import budget_metrics
from megarl.trainer.streaming import StreamingScheduler
from reference import allocation as ref

HF = dict(TINY_QWEN3_HF)
N = 4


class AbandonOnFailure:
    """Issues the whole group at once as single-sample requests, abandons at the first failure seen:
    its abandoned prompts still have requests in flight."""

    want, request_size = 5, 1

    def budget(self, n: int, max_new_tokens: int) -> StepBudget:
        return StepBudget(self.want * n)

    def decide(self, view: PromptView) -> int:
        return ABANDON if 0.0 in view.outcomes else view.n

    def end_step(self, step, prompts):
        return {}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


@pytest.fixture(scope="module")
def parts():
    cfg = from_dict(
        {
            "model": {"hf_config": HF, "alphabet": "0123456789R= "},
            "data": {"train": "unused.jsonl"},
            # reward 1 when the first generated character is a digit below 5: random under a random model
            "reward": {"functions": [{"name": "low", "kind": "regex", "pattern": "^[0-4]"}]},
            "rollout": {"n": N, "max_new_tokens": 3},
            "schedule": {"prompts_per_step": 5, "seed": 5},
        }
    )
    run = Run(cfg)
    run.tok = CharTokenizer(cfg.model.alphabet)
    torch.manual_seed(0)
    model = hf_model_from_config(
        dict(HF, vocab_size=run.tok.vocab_size, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    )
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.02)  # near-uniform sampling: outcomes of every kind
    rows = [
        PromptRow(prompt=f"R {i:03d}=", answer="x", task="reverse", source=f"mem:{i}") for i in range(100)
    ]
    # one request at a time (no continuous batching): an abandoned prompt's later requests are still
    # queued when its first failure arrives, whatever the machine's load
    engine = EmbeddedEngine(model, eos_token_ids=[1], max_batch_rows=1)
    yield cfg, run, engine, PromptDataset(rows), RewardComputer(cfg.reward)
    engine.shutdown("tests done", wait=30)  # requests no step awaited may still be decoding


def collector(parts, allocator) -> RolloutCollector:
    cfg, run, engine, ds, rewards = parts
    return RolloutCollector(
        engine=engine,
        tokenizer=run.tok,
        dataset=ds,
        sampler=PromptSampler(len(ds.rows), 0),
        rewards=rewards,
        workflow=SingleTurn(WorkflowContext(run.tok, lambda t, a: (0.0, False), None, cfg.environment)),
        processors=[],
        allocator=allocator,
        sampling=run.sampling_params,
        n=N,
        weights={"low": 1.0},
        fallback=0.0,
        version=lambda: 0,
    )


def run_step(parts, allocator, step=1):
    c = collector(parts, allocator)
    sched = StreamingScheduler(c, allocator)
    batch = asyncio.new_event_loop().run_until_complete(sched.collect(step))
    return c, sched, batch


def check_against_reference(sched, decide, want, budget, request_size):
    seen = {s.index: s.outcomes for s in sched.slots}
    expect = ref.simulate_step(decide, lambda slot, j: seen[slot][j], N, want, budget, request_size)
    assert [(s.state, s.issued, s.outcomes) for s in sched.slots] == [tuple(e) for e in expect]


def test_sara_step_matches_reference_and_stays_in_budget(parts):
    k = SARAKnobs(probe=2, tau_lo=0.45, tau_hi=0.9, history_decay=0.0)
    alloc = SARAAllocator(k, want=5)
    c, sched, b = run_step(parts, alloc)
    decide = lambda slot, out: ref.sara_decide(out, N, 1.0, 1.0, 2, 0.45, 0.9, out)  # noqa: E731
    check_against_reference(sched, decide, 5, 5 * N, 0)
    states = [s.state for s in sched.slots]
    assert "abandoned" in states and "committed" in states, states  # the test needs both kinds
    assert c.sampler.cursor == len(sched.slots)  # one sampler draw per opened prompt
    st = b.stats
    assert st["budget_samples"] == sum(s.issued for s in sched.slots) <= 5 * N
    assert [g.uid for g in b.groups] == [s.uid for s in sched.slots if s.state == "committed"]
    assert all(len(g.samples) == N and len(g.rewards) == N for g in b.groups)
    m = budget_metrics(st)
    eff = [g for g in b.groups if len(set(g.rewards)) > 1]
    assert m["budget/groups_effective"] == len(eff) and m["budget/samples_effective"] == N * len(eff)
    assert m["budget/samples_saved_vs_fixed"] == 5 * N - st["budget_samples"]
    assert st["method"]["alloc/prompts_abandoned"] == states.count("abandoned")
    # history: every opened prompt is in it after the step
    assert sorted(alloc.history) == sorted(s.uid for s in sched.slots)


def test_same_sampler_position_repeats_the_step(parts):
    k = SARAKnobs(probe=2, tau_lo=0.45, tau_hi=0.9, history_decay=0.0)
    _, s1, b1 = run_step(parts, SARAAllocator(k, want=5), step=3)
    _, s2, b2 = run_step(parts, SARAAllocator(k, want=5), step=3)
    assert [(s.uid, s.state, s.issued) for s in s1.slots] == [(s.uid, s.state, s.issued) for s in s2.slots]
    assert [[x.token_ids for x in g.samples] for g in b1.groups] == [
        [x.token_ids for x in g.samples] for g in b2.groups
    ]


def test_abandoned_prompts_requests_are_aborted_on_the_engine(parts):
    alloc = AbandonOnFailure()
    _, sched, b = run_step(parts, alloc, step=2)
    decide = lambda slot, out: ABANDON if 0.0 in out else N  # noqa: E731
    check_against_reference(sched, decide, 5, 5 * N, 1)
    m = b.stats["method"]
    assert m["alloc/prompts_abandoned"] > 0
    assert m["alloc/requests_aborted"] > 0  # queued behind the embedded engine's one model
    assert m["alloc/samples_abandoned"] == sum(s.issued for s in sched.slots if s.state == "abandoned")
    assert all(set(g.rewards) == {1.0} for g in b.groups)  # only all-success groups were committed


def test_a_bad_decision_is_named(parts):
    class Bad(AbandonOnFailure):
        def decide(self, view):
            return view.n + 1

    with pytest.raises(ValueError, match=r"decide\(\) returned 5 for a prompt with 0 of 4 samples"):
        run_step(parts, Bad())


def test_a_prompt_chooser_picks_the_round_prompts(parts):
    """A round allocator that chooses prompts (PAC) gets the dataset's tasks, names the round's
    prompts instead of the sampler and sees the round's groups."""
    from megarl.methods.allocation.pac import PACAllocator, PACKnobs

    cfg, run, engine, _, rewards = parts
    rows = [
        PromptRow(prompt=f"R {i:03d}=", answer="x", task=("a" if i % 2 else "b"), source=f"mem:{i}")
        for i in range(40)
    ]
    alloc = PACAllocator(PACKnobs(), want=6)
    c = collector((cfg, run, engine, PromptDataset(rows), rewards), alloc)
    b = asyncio.new_event_loop().run_until_complete(c.collect(4))
    chosen = [g.uid for g in b.groups]
    assert c.sampler.cursor == 0 and len(chosen) == 6  # the sampler was not asked
    assert [rows[u].task for u in chosen] == ["a"] * alloc.last_counts["a"] + ["b"] * alloc.last_counts["b"]
    assert sorted(alloc.stats) == sorted({rows[u].task for u in chosen})
    assert b.stats["method"]["pac/a/prompts"] == alloc.last_counts["a"]


def test_a_token_budget_caps_what_the_step_is_charged(parts):
    """With a token budget of 2 groups' worth of max_new_tokens, the step's charges (landed tokens;
    max_new_tokens per abandoned sample that did not count) stay within it, and it opens fewer
    prompts than the same allocator under its sample budget alone."""

    class TokenCapped(AbandonOnFailure):
        def budget(self, n, max_new_tokens):
            return StepBudget(samples=self.want * n, tokens=2 * n * max_new_tokens)

    _, free, _ = run_step(parts, AbandonOnFailure(), step=5)
    _, sched, b = run_step(parts, TokenCapped(), step=5)
    cap = 2 * N * sched.max_new
    charged = sum(
        s.tokens() + (s.issued - len(s.outcomes)) * sched.max_new * (s.state == "abandoned")
        for s in sched.slots
    )
    assert charged <= cap and len(sched.slots) < len(free.slots), (charged, cap, len(sched.slots))
    assert b.stats["budget_tokens"] == sum(s.tokens() for s in sched.slots)
