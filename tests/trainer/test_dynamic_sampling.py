"""DAPO dynamic sampling in the rollout collector, with the real embedded engine on a tiny
random transformers model (no learner needed): kept groups always have unequal rewards, dropped
groups are counted, and the number of sampling rounds is capped."""

import asyncio

import torch

from megarl.data.dataset import PromptDataset, PromptRow, PromptSampler
from megarl.data.tokenizer import CharTokenizer
from megarl.rewards.compute import RewardComputer
from megarl.rollout.embedded import EmbeddedEngine, hf_model_from_config
from megarl.rollout.workflow import SingleTurn, WorkflowContext
from megarl.testing.tiny_qwen3 import TINY_QWEN3_HF
from megarl.trainer.allocation import allocator_from_config
from megarl.trainer.collector import RolloutCollector
from megarl.trainer.config import from_dict
from megarl.trainer.rollouts import rollouts_from_groups
from megarl.trainer.run import Run

HF = dict(TINY_QWEN3_HF)


class Collecting:
    """The rollout phase alone: the run's ``RolloutCollector`` over an embedded engine, flattened
    into the step's ``Rollouts`` as the synchronous loop does."""

    def __init__(self, collector: RolloutCollector, loop, task_id: dict, names: list):
        self.c, self.loop, self.task_id, self.names = collector, loop, task_id, names

    def rollout(self, step: int):
        b = self.loop.run_until_complete(self.c.collect(step))
        return rollouts_from_groups(b.groups, self.task_id, self.names, with_versions=False), b.stats


def trainer(dynamic: bool, max_rounds: int = 3) -> Collecting:
    cfg = from_dict(
        {
            "model": {"hf_config": HF, "alphabet": "0123456789R= "},
            "data": {"train": "unused.jsonl"},
            # reward 1 when the first generated character is a digit below 5: random under a random model
            "reward": {"functions": [{"name": "low", "kind": "regex", "pattern": "^[0-4]"}]},
            "rollout": {"n": 4, "max_new_tokens": 3},
            "schedule": {"prompts_per_step": 6, "seed": 5},
            "sampling": {"dynamic": dynamic, "max_rounds": max_rounds},
        }
    )
    run = Run(cfg)
    run.tok = CharTokenizer(cfg.model.alphabet)
    torch.manual_seed(0)
    model = hf_model_from_config(
        dict(HF, vocab_size=run.tok.vocab_size, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    )
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.02)  # near-uniform sampling: groups of every kind
    engine = EmbeddedEngine(model, eos_token_ids=[1])
    rows = [
        PromptRow(prompt=f"R {i:03d}=", answer=f"{i:03d}"[::-1], task="reverse", source=f"mem:{i}")
        for i in range(200)
    ]
    ds = PromptDataset(rows)
    rewards = RewardComputer(cfg.reward)
    wctx = WorkflowContext(run.tok, lambda t, a: (0.0, False), None, cfg.environment)
    c = RolloutCollector(
        engine=engine,
        tokenizer=run.tok,
        dataset=ds,
        sampler=PromptSampler(len(rows), 0),
        rewards=rewards,
        workflow=SingleTurn(wctx),
        processors=[],
        allocator=allocator_from_config(cfg),
        sampling=run.sampling_params,
        n=cfg.rollout.n,
        weights={"low": 1.0},
        fallback=0.0,
        version=lambda: 0,
    )
    return Collecting(c, asyncio.new_event_loop(), ds.task_id, rewards.names)


def groups_of(ro):
    out = {}
    for g, r in zip(ro.group_ids, ro.rewards):
        out.setdefault(g, []).append(r)
    return out


def test_without_dynamic_sampling_every_group_is_kept():
    t = trainer(dynamic=False)
    ro, st = t.rollout(step=1)
    assert st["rounds"] == 1 and st["groups_seen"] == 6
    assert len(groups_of(ro)) == 6 and len(ro.rewards) == 24


def test_dynamic_sampling_keeps_only_informative_groups():
    t = trainer(dynamic=True, max_rounds=6)
    ro, st = t.rollout(step=1)
    gs = groups_of(ro)
    assert gs, "no informative group in 6 rounds"
    for rewards in gs.values():
        assert len(rewards) == 4 and len(set(rewards)) > 1
    assert sorted(gs) == list(range(len(gs)))  # group ids stay dense
    assert st["groups_seen"] == len(gs) + st["groups_zero_var"]
    assert st["groups_zero_var"] > 0, "the test needs some constant groups to be meaningful"
    assert len(gs) == 6 or st["rounds"] == 6


def test_dynamic_sampling_stops_at_max_rounds():
    t = trainer(dynamic=True, max_rounds=1)
    ro, st = t.rollout(step=2)
    assert st["rounds"] == 1 and st["groups_seen"] == 6
    assert len(groups_of(ro)) == 6 - st["groups_zero_var"]
