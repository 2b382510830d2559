"""Accuracy comes from the reward marked as the correctness check, never from a threshold on the
weighted sum: with the AMRP example's rewards (exact match + digits-only format, weight 1 each) a
well-formatted wrong answer sums to 1.0, the largest single weight, yet is wrong."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from megarl.data.dataset import PromptDataset, PromptRow
from megarl.data.tokenizer import CharTokenizer
from megarl.rewards.compute import RewardComputer
from megarl.rollout.types import GenerateResult, Sample
from megarl.rollout.workflow import RetryTask
from megarl.trainer.config import ConfigError, from_dict
from megarl.trainer.evaluation import evaluate
from megarl.trainer.run import Run

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "examples/quickstart.yaml").read_text())
AMRP_REWARD = yaml.safe_load((ROOT / "examples/methods/amrp.yaml").read_text())["reward"]


def amrp_config(mark: bool = True, **schedule):
    d = copy.deepcopy(BASE)
    d["reward"] = copy.deepcopy(AMRP_REWARD)
    if not mark:
        for f in d["reward"]["functions"]:
            f.pop("correct", None)
    d["schedule"].update(schedule)
    return from_dict(d)


class ScriptedEngine:
    """Answers every prompt with the next texts of a fixed list (the policy's outputs in this test)."""

    def __init__(self, tok, texts):
        self.tok, self.texts = tok, list(texts)

    async def generate(self, prompt_ids, n=1, sampling=None, **_):
        return GenerateResult(
            list(prompt_ids),
            [Sample(self.tok.encode(self.texts.pop(0), bos=False), [0.0], "stop") for _ in range(n)],
        )


def test_format_only_answers_are_not_correct_in_held_out_accuracy():
    cfg = amrp_config(eval_samples=4, eval_k=2)
    tok = CharTokenizer(cfg.model.alphabet)
    rows = [
        PromptRow(f"R {a[::-1]}=", a, "reverse", f"mem:{i}") for i, a in enumerate(["12", "34", "56", "78"])
    ]
    # greedy: right, format-only (digits, wrong value), format-only, wrong format and value;
    # sampled (k=2 per prompt): prompt 0 both wrong-but-formatted, prompt 1 one right
    texts = ["12", "99", "11", "R"] + ["00", "01", "34", "55", "RR", "66", "7", "8"]
    run = SimpleNamespace(
        cfg=cfg,
        tok=tok,
        eval_ds=PromptDataset(rows),
        engine=ScriptedEngine(tok, texts),
        rewards=RewardComputer(cfg.reward),
        loop=asyncio.new_event_loop(),
        sampling_params=lambda step, rnd, i, greedy=False: Run.sampling_params(run, step, rnd, i, greedy),
    )
    try:
        out = evaluate(run)
    finally:
        run.loop.close()
    assert out["eval/pass@1"] == pytest.approx(0.25)  # only "12"; the sum threshold said 0.75
    assert out["eval/reward_greedy"] == pytest.approx((2 + 1 + 1 + 0) / 4)  # the weighted sum, kept
    assert out["eval/pass@2"] == pytest.approx(0.25)  # prompt 1 only; the sum threshold said 1.0
    assert out["eval/sampled_acc"] == pytest.approx(1 / 8)


def test_reward_result_carries_the_marked_verdict():
    cfg = amrp_config()
    res = RewardComputer(cfg.reward)(["21", "99", "2x"], ["21", "21", "21"])
    assert res.scalar.tolist() == [2.0, 1.0, 0.0]
    assert res.correct.tolist() == [True, False, False]


def test_several_rewards_without_a_marked_correctness_check_are_refused():
    with pytest.raises(ConfigError, match=r"reward\.functions\[0\]\.correct: true.*'correct'"):
        amrp_config(mark=False)
    d = copy.deepcopy(BASE)
    d["reward"] = copy.deepcopy(AMRP_REWARD)
    d["reward"]["functions"][1]["correct"] = True
    with pytest.raises(ConfigError, match=r"reward\.functions\[1\]\.correct \('format'\).*only one"):
        from_dict(d)
    d["reward"]["functions"][0].pop("correct")  # the format reward alone is marked: allowed
    assert RewardComputer(from_dict(d).reward).correct_name == "format"
    single = copy.deepcopy(BASE)
    single["reward"]["functions"][0].pop("correct", None)
    assert RewardComputer(from_dict(single).reward).correct_name == "correct"  # the only reward


def test_retry_task_stops_on_a_correct_answer_not_on_a_high_reward():
    tok = CharTokenizer(BASE["model"]["alphabet"])
    rewards = RewardComputer(amrp_config().reward)

    def score(text):
        res = rewards([text], ["321"])
        return float(res.scalar[0]), bool(res.correct[0])

    env = RetryTask(tok, "R 123=", score=score, max_turns=3)
    env.reset()
    formatted = env.step(tok.encode("123", bos=False))  # reward 1.0 from the format alone
    assert not formatted.done and formatted.reward == 0.0 and formatted.info["reward"] == 1.0
    assert env.step(tok.encode("321", bos=False)).done
