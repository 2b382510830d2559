"""The ``instructed`` workflow and per-sample workflow extras, through the real rollout collector,
reward functions, checkpoint JSON and batch builder (the engine is scripted): each sample is
generated from prompt + its drawn instruction, the trained sequence is the plain prompt and the
response, the draws are seeded, the extras reach round processors and the batch, and with no
instructions the workflow is the single-turn one."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from megarl.data.dataset import PromptDataset, PromptRow, PromptSampler
from megarl.data.tokenizer import CharTokenizer
from megarl.plugin.inputs import RolloutInfo
from megarl.plugin.rounds import RoundResult
from megarl.rewards.compute import RewardComputer
from megarl.rollout.instructed import InstructedWorkflow, draw_instructions
from megarl.rollout.types import GenerateResult, Sample, SamplingParams
from megarl.rollout.workflow import SingleTurn, Trajectory, WorkflowContext
from megarl.trainer.allocation import allocator_from_config
from megarl.trainer.collector import RolloutCollector, sample_extras
from megarl.trainer.config import from_dict
from megarl.trainer.method_runtime import MethodRuntime
from megarl.trainer.rollouts import batch_from_json, batch_to_json, build_batch, rollouts_from_groups

ALPHABET = "0123456789+=RC "


class Echo:
    """Answers '12' after a prompt ending in 'C', '99' after 'RR', '33' otherwise; records requests."""

    def __init__(self, tok):
        self.tok, self.requests = tok, []

    async def generate(self, prompt_ids, n=1, sampling=None, **_):
        self.requests.append((list(prompt_ids), n, sampling.seed))
        text = self.tok.decode(list(prompt_ids))
        ans = "12" if text.endswith("C") else "99" if text.endswith("RR") else "33"
        ids = self.tok.encode(ans, bos=False)
        return GenerateResult(list(prompt_ids), [Sample(ids, [-0.5] * len(ids), "stop")] * n)


class Seen:
    """A round processor that keeps the round's workflow extras."""

    async def process(self, r):
        self.extras = r.extras
        return RoundResult()

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _collect(instructions, n=6, seed=7):
    tok = CharTokenizer(ALPHABET)
    cfg = from_dict(
        {
            "model": {"alphabet": ALPHABET, "hf_config": {"model_type": "qwen3"}},
            "data": {"train": "unused.jsonl"},
            "reward": {"functions": [{"name": "correct", "kind": "exact_match", "correct": True}]},
            "environment": {"name": "instructed", "instructions": instructions},
            "rollout": {"n": n},
            "schedule": {"prompts_per_step": 1, "seed": 5},
        }
    )
    engine, seen = Echo(tok), Seen()
    ds = PromptDataset([PromptRow(prompt="R 21=", answer="12", task="reverse", source="mem:0")])
    rewards = RewardComputer(cfg.reward)
    wf = InstructedWorkflow(WorkflowContext(tok, lambda t, a: (0.0, False), None, cfg.environment))
    c = RolloutCollector(
        engine=engine,
        tokenizer=tok,
        dataset=ds,
        sampler=PromptSampler(1, 0),
        rewards=rewards,
        workflow=wf,
        processors=[seen],
        allocator=allocator_from_config(cfg),
        sampling=lambda step, rnd, i: SamplingParams(max_new_tokens=4, seed=seed),
        n=n,
        weights={"correct": 1.0},
        fallback=0.0,
        version=lambda: 0,
    )
    collected = batch_from_json(batch_to_json(asyncio.run(c.collect(1))))  # the checkpoint form keeps them
    ro = rollouts_from_groups(collected.groups, ds.task_id, rewards.names, False)
    batch = build_batch(ro, 1)
    MethodRuntime.add_round_extras(
        batch, RolloutInfo(ro.answers, ro.reward_dims, ro.extras)
    )  # as the loop does
    return tok, engine, seen, batch


def test_each_sample_is_drawn_with_its_instruction_and_trained_on_the_plain_prompt():
    tok, engine, seen, batch = _collect(["C", "RR"])
    picks = draw_instructions(2, 6, 7)
    assert batch.extras["instruction"].tolist() == [float(j) for j in picks]
    assert len(set(picks)) > 1  # this seed draws more than one kind
    want = {0: "33", 1: "12", 2: "99"}
    prompt = tok.encode("R 21=")
    for i, j in enumerate(picks):
        seq = batch.tokens[int(batch.cu_seqlens[i]) : int(batch.cu_seqlens[i + 1])].tolist()
        assert seq == prompt + tok.encode(want[j], bos=False)  # no instruction in the trained tokens
    assert batch.rewards.tolist() == [1.0 if j == 1 else 0.0 for j in picks]
    rows = batch.extras["instruction_context"]
    assert rows.shape == (6, 2)
    for i, j in enumerate(picks):
        ids = [int(x) for x in rows[i].tolist() if not math.isnan(x)]
        assert tok.decode(ids) == ["", "C", "RR"][j]
    assert {tok.decode(p) for p, _, _ in engine.requests} == {
        ["R 21=", "R 21=C", "R 21=RR"][j] for j in picks
    }
    assert sum(n for _, n, _ in engine.requests) == 6
    assert seen.extras["instruction"] == [float(j) for j in picks]  # round processors see them too
    assert _collect(["C", "RR"])[3].extras["instruction"].tolist() == batch.extras["instruction"].tolist()


def test_no_instructions_is_the_single_turn_workflow():
    tok, engine, _, batch = _collect([])
    assert engine.requests == [(tok.encode("R 21="), 6, 7)]  # one request of n, the same seed
    assert batch.extras["instruction"].tolist() == [0.0] * 6
    assert torch.isnan(batch.extras["instruction_context"]).all()
    ctx = WorkflowContext(tok, lambda t, a: (0.0, False), None, None)
    plain = asyncio.run(
        SingleTurn(ctx).run(Echo(tok), "R 21=", "12", tok.encode("R 21="), 6, SamplingParams(seed=7))
    )
    assert [t.token_ids for t in plain] == [
        batch.tokens[
            int(batch.cu_seqlens[i]) + len(tok.encode("R 21=")) : int(batch.cu_seqlens[i + 1])
        ].tolist()
        for i in range(6)
    ]


def test_samples_with_different_extras_are_refused_by_name():
    from megarl.trainer.rollouts import GroupRecord, SampleRecord

    def rec(extras):
        return SampleRecord([1], [-0.1], "stop", 0, extras=extras)

    g = GroupRecord(PromptRow("p", "a", "t", "s"), 0, [1], [rec({"a": 1.0}), rec({"b": 1.0})])
    with pytest.raises(ValueError, match="sample 1 carries"):
        sample_extras([g])
    assert sample_extras([GroupRecord(PromptRow("p", "a", "t", "s"), 0, [1], [rec(None)])]) == {}
    assert Trajectory([1], [0.0], "stop", False).extras is None


def test_evaluation_reads_the_plain_prompt_without_an_instruction():
    from types import SimpleNamespace

    from megarl.trainer.evaluation import _generate

    tok = CharTokenizer(ALPHABET)
    engine = Echo(tok)
    run = SimpleNamespace(
        engine=engine, tok=tok, sampling_params=lambda s, r, i, g=False: SamplingParams(seed=i)
    )
    rows = [PromptRow(prompt="R 21=", answer="12", task="reverse", source="mem:0")]
    asyncio.run(_generate(run, rows, 2, step=-1))
    assert [tok.decode(p) for p, _, _ in engine.requests] == ["R 21="]
