"""The trainer's method plumbing without a model: config validation of the method sections, which
inputs each example needs, the batch inputs the trainer derives (single-turn steps, DASH
checkpoints, reward dimensions), estimator state round trips, the reward-shaping mapping and the
judge tokenizer."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import torch
import yaml

from megarl.batch import from_sequences
from megarl.data.tokenizer import CharTokenizer
from megarl.methods.credit.step_inputs import single_turn_spans
from megarl.plugin.context import RunContext
from megarl.plugin.core_inputs import teacher_hf_config
from megarl.plugin.inputs import RolloutInfo
from megarl.plugin.rounds import RolloutRound
from megarl.plugin.teacher_config import teacher_config
from megarl.rewards.shaping.cedar import evidence_items
from megarl.rewards.shaping.judge import JudgeTokenizer
from megarl.rewards.shaping.processor import ShapingProcessor
from megarl.rewards.shaping.reward_floor import words
from megarl.rollout.workflow import RetryTask
from megarl.trainer.config import ConfigError, from_dict
from megarl.trainer.method_runtime import MethodRuntime, required_inputs
from megarl.trainer.rollouts import apply_answer_masks
from tests.methods.test_family2_trainer import QUICKSTART, spliced

BASE = yaml.safe_load(QUICKSTART.read_text())


def context(cfg) -> RunContext:
    """A run context without learners or engine (batch-side parts only)."""
    tok = CharTokenizer(cfg.model.alphabet)
    return RunContext(
        cfg=cfg,
        tokenizer=tok,
        hf_config={},
        rank0=True,
        init_dir=Path("unused"),
        make_learner=lambda *a, **k: None,
    )


class MethodInputs:
    """The method side of a run as the trainer composes it, minus learners and engine."""

    def __init__(self, cfg):
        self.rt = MethodRuntime.build_learner_side(context(cfg))
        self.estimator_state = self.rt.advantages.state

    def fill_batch(self, batch, tok, answers, reward_dims, extras=None):
        self.rt.fill_batch_inputs(batch, RolloutInfo(answers, reward_dims, extras or {}))

    def advantages(self, batch):
        return self.rt.advantages(batch)

    def state_dict(self):
        return self.rt.state_dict()

    def load_state_dict(self, st):
        self.rt.load_state_dict(st)


class RewardShaping:
    """The configured shaper as the collector runs it (a round processor)."""

    def __init__(self, cfg, run=None):
        self.p = ShapingProcessor(
            RunContext(
                cfg=cfg,
                tokenizer=None,
                hf_config={},
                rank0=True,
                init_dir=Path("unused"),
                make_learner=lambda *a, **k: None,
            )
        )

    def shape(self, r, step):
        r.step = step
        return asyncio.run(self.p.process(r))


def cfg_with(**sections) -> dict:
    d = copy.deepcopy(BASE)
    for k, v in sections.items():
        d[k] = v if k in ("advantage", "objective") else {**d.get(k, {}), **v}
    return d


@pytest.mark.parametrize(
    "section, msg",
    [
        ({"reward": {"shaping": {"name": "amrp", "tau2": 1.0}}}, "reward.shaping.tau2"),
        ({"reward": {"shaping": {"name": "nope"}}}, "reward.shaping.name='nope'; allowed"),
        (
            {"reward": {"shaping": {"name": "amrp", "eta": "high"}}},
            "reward.shaping.eta='high' must be a number",
        ),
        ({"reward": {"shaping": ["amrp"]}}, "reward.shaping"),
        ({"reward": {"judge": {"timeout_s": 0}}}, "reward.judge.timeout_s=0"),
        ({"inputs": {"answer_checkpoints": {"pattern": "(unclosed"}}}, "inputs.answer_checkpoints: pattern"),
        (
            {"inputs": {"rrpo_scores": {"anchors": 1}}, "advantage": {"estimator": "rrpo"}},
            "inputs.rrpo_scores: anchors=1",
        ),
        (
            {"inputs": {"rrpo_scores": {"positive_prompt": "{gold} {prompt}"}}},
            "inputs.rrpo_scores: positive_prompt",
        ),
        ({"inputs": {"rrpo_scores": {"head_stepz": 3}}}, "unknown key inputs.rrpo_scores.head_stepz"),
        ({"inputs": {"nope": {}}}, "no provider for batch input 'nope'"),
        ({"method": {"name": "nope"}}, "method.name='nope'; built-in methods"),
        (
            {"method": {"import": "no_such_pkg.mod:SPEC"}},
            "method.import='no_such_pkg.mod:SPEC': cannot import",
        ),
        ({"environment": {"name": "maze"}}, "environment.name='maze'; allowed"),
        ({"environment": {"max_turns": 0}}, "environment.max_turns=0"),
        ({"environment": {"feedback": "{answer}"}}, "environment.feedback"),
        (
            {
                "objective": {"policy_loss": "none", "distill": "forward_kl", "distill_coef": 1.0},
                "teacher": {"source": "engine", "urls": ["http://127.0.0.1:1"]},
            },
            "objective.distill='forward_kl' needs the teacher's full-vocabulary logits, which only",
        ),
        ({"teacher": {"hf_dirr": "x"}}, "unknown key teacher.hf_dirr"),
    ],
)
def test_bad_method_sections_name_the_key(section, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace("[", r"\[")):
        from_dict(cfg_with(**section))


@pytest.mark.parametrize(
    "name, want",
    [
        ("gepo", {"entropies"}),
        ("eppo", {"entropies"}),
        ("cokl", {"ref_logprobs"}),
        ("gigpo", {"steps"}),
        ("pgpo", {"steps"}),
        ("dash", {"answer_checkpoints"}),
        ("rspo", {"reward_dims"}),
        ("rrpo", {"rrpo_scores"}),
        ("core-grpo", {"ref_logprobs"}),
        ("core-dapo", set()),
        ("taco", set()),
        ("core-onpolicy-distill", {"teacher_logprobs"}),
        ("core-distill-full-vocab", {"teacher_logits"}),
    ],
)
def test_required_inputs_of_the_examples(name, want):
    assert set(required_inputs(from_dict(spliced(name)))) == want


def _batch():
    tok = CharTokenizer(BASE["model"]["alphabet"])
    prompts = [tok.encode("R 123="), tok.encode("R 123="), tok.encode("R 45=")]
    responses = [tok.encode("321 32", bos=False), tok.encode("9", bos=False), tok.encode("54", bos=False)]
    b = from_sequences(prompts, responses, [0, 0, 1], rewards=torch.tensor([1.0, 0.0, 1.0]))
    return tok, b


def test_single_turn_steps_share_the_prompt_state_within_a_group():
    tok, b = _batch()
    mi = MethodInputs(from_dict(spliced("gigpo")))
    mi.fill_batch(b, tok, ["321", "321", "54"], {"correct": [1.0, 0.0, 1.0]})
    assert b.turn_spans == single_turn_spans(b)
    assert b.turn_spans[0] == [(0, 7, "prompt"), (7, 13, "assistant")]
    keys = b.extras["step_state_keys"]
    assert keys.shape == (3, 1) and keys[0, 0] == keys[1, 0] != keys[2, 0]
    adv = mi.advantages(b)
    assert adv.shape == (b.num_tokens,) and bool((adv[b.loss_mask == 0] == 0).all())


def test_dash_checkpoints_from_the_answer_pattern():
    tok, b = _batch()
    mi = MethodInputs(from_dict(spliced("dash")))
    mi.fill_batch(b, tok, ["321", "321", "54"], {})
    # "321 32": two digit runs; the first equals the answer and ends after response token 3
    assert b.extras["dash_ends"][0].tolist() == [7 + 3, 7 + 6]
    assert b.extras["dash_correct"][0].tolist() == [1.0, 0.0]
    assert b.extras["dash_correct"][1].tolist()[0] == 0.0 and b.extras["dash_correct"][2].tolist()[0] == 1.0
    mi.advantages(b)


def test_rspo_gets_the_named_reward_dimensions():
    tok, b = _batch()
    mi = MethodInputs(from_dict(spliced("rspo")))
    mi.fill_batch(b, tok, ["321"] * 3, {"correct": [1.0, 0.0, 1.0], "format": [0.0, 1.0, 1.0]})
    assert b.reward_names == ["correct", "format"] and b.rewards.shape == (3, 2)
    mi.advantages(b)


def test_gepo_state_round_trip_and_mismatch_named():
    _, b = _batch()
    b.entropies = torch.rand(b.num_tokens)
    mi = MethodInputs(from_dict(spliced("gepo")))
    mi.advantages(b)
    st = mi.state_dict()
    assert st["estimator"]["mean"] is not None
    other = MethodInputs(from_dict(spliced("gepo")))
    other.load_state_dict(st)
    assert other.estimator_state.state_dict() == mi.estimator_state.state_dict()
    with pytest.raises(ValueError, match="advantage.estimator='grpo' has no state"):
        MethodInputs(from_dict(spliced("core-dapo"))).load_state_dict(st)


def _round(dims: dict[str, list[float]], weights: dict[str, float], texts, prompts, n=2):
    d = {k: torch.tensor(v) for k, v in dims.items()}
    scalar = sum(weights[k] * d[k] for k in d)
    G = len(prompts)
    return RolloutRound(
        prompts,
        ["321"] * G,
        list(range(G)),
        [[0]] * G,
        [[0]] * (G * n),
        texts,
        d,
        scalar,
        n,
        step=1,
        round=0,
        weights=dict(weights),
    )


def test_reward_floor_on_words_of_the_prompt():
    cfg = from_dict(cfg_with(reward={"shaping": {"name": "reward_floor", "floor": -1.0}}))
    sh = RewardShaping(cfg, run=None)
    r = _round({"correct": [0.0, 1.0]}, {"correct": 1.0}, ["123", "321"], ["R 123="])
    out = sh.shape(r, step=1)
    assert out.scalar.tolist() == [-1.0, 1.0]  # copying the operand is floored, the reversal is not
    assert out.metrics["shaping/reward_floor/copied_frac"] == 0.5
    assert words("R 123=") == "R 123"


def test_amrp_and_rubric_dropout_use_the_reward_dimensions():
    fns = [
        {"name": "correct", "kind": "exact_match", "correct": True},
        {"name": "format", "kind": "regex", "pattern": "^\\d+$"},
    ]
    dims = {"correct": [0.0, 1.0, 0.0, 0.0], "format": [1.0, 1.0, 0.0, 1.0]}
    amrp = RewardShaping(
        from_dict(cfg_with(reward={"functions": fns, "shaping": {"name": "amrp"}})), run=None
    )
    out = amrp.shape(_round(dims, {"correct": 1.0, "format": 1.0}, ["a"] * 4, ["R 1=", "R 2="]), step=1)
    w = [out.metrics["shaping/amrp/w/correct"], out.metrics["shaping/amrp/w/format"]]
    assert abs(sum(w) - 1) < 1e-9 and out.scalar.shape == (4,)
    rd = RewardShaping(
        from_dict(cfg_with(reward={"functions": fns, "shaping": {"name": "rubric_dropout", "p": 0.5}})),
        run=None,
    )
    got = [
        rd.shape(_round(dims, {"correct": 1.0, "format": 1.0}, ["a"] * 4, ["R 1=", "R 2="]), step=s)
        for s in range(1, 9)
    ]
    kept = [g.metrics["shaping/rubric_dropout/kept_frac"] for g in got]
    assert min(kept) < 1.0 and all(k > 0 for k in kept)
    for g in got:  # one mask per group: both samples of a group are scored against the same criteria
        assert g.scalar.shape == (4,)


def test_judged_shapers_need_a_judge():
    with pytest.raises(ValueError, match="needs an LLM judge"):
        RewardShaping(from_dict(cfg_with(reward={"shaping": {"name": "cedar"}})), run=None)


def test_judge_tokenizer_drops_unknown_characters_and_keeps_the_tail():
    tok = CharTokenizer("0123456789 ")
    jt = JudgeTokenizer(tok, max_prompt_tokens=6)
    ids = jt.encode("score: 0.75 for 123456789", add_special_tokens=False)
    assert len(ids) == 6 and ids[0] == tok.bos_id
    assert jt.decode(ids[1:]) == "56789"  # BOS + the last 5 tokens
    assert evidence_items("R 4071=") == ["4", "0", "7", "1"]


def test_retry_task_asks_again_until_correct_or_out_of_turns():
    tok = CharTokenizer(BASE["model"]["alphabet"])
    env = RetryTask(
        tok, "R 123=", score=lambda t: (float(t.strip() == "321"), t.strip() == "321"), max_turns=3
    )
    assert env.reset() == tok.encode("R 123=")
    wrong = env.step(tok.encode("123", bos=False))
    assert (
        not wrong.done and wrong.reward == 0.0 and wrong.observation_ids == tok.encode(" R 123=", bos=False)
    )
    right = env.step(tok.encode("321", bos=False))
    assert right.done and right.reward == 1.0 and right.observation_ids == []
    env.reset()
    for _ in range(2):
        assert not env.step(tok.encode("1", bos=False)).done
    assert env.step(tok.encode("1", bos=False)).done  # max_turns


def test_episode_structure_masks_observations():
    tok, b = _batch()
    masks = [[1.0, 1.0, 0.0, 0.0, 1.0, 1.0], [1.0], [1.0, 1.0]]
    spans = [
        [(0, 7, "prompt"), (7, 9, "assistant"), (9, 11, "observation"), (11, 13, "assistant")],
        [(0, 7, "prompt"), (7, 8, "assistant")],
        [(0, 6, "prompt"), (6, 8, "assistant")],
    ]
    apply_answer_masks(b, masks, spans)
    assert b.loss_mask[7:13].tolist() == masks[0] and b.turn_spans == spans
    MethodInputs(from_dict(spliced("gigpo"))).fill_batch(b, tok, ["321"] * 3, {})
    assert (b.extras["step_state_keys"] >= 0).sum(1).tolist() == [2, 1, 1]
    with pytest.raises(ValueError, match="sequence 1: response mask has 2 entries"):
        apply_answer_masks(b, [masks[0], [1.0, 1.0], masks[2]], spans)


def test_teacher_needs_a_checkpoint_with_the_policy_vocabulary(tmp_path):
    import json

    cfg = from_dict(spliced("core-onpolicy-distill"))
    with pytest.raises(ValueError, match="needs teacher.hf_dir"):
        teacher_hf_config(cfg, {"vocab_size": 24})
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "vocab_size": 32, "eos_token_id": 9})
    )
    teacher_config(cfg).hf_dir = str(tmp_path)
    with pytest.raises(ValueError, match="vocab_size 32 differs from the policy's 24"):
        teacher_hf_config(cfg, {"vocab_size": 24})
    hf = teacher_hf_config(cfg, {"vocab_size": 32, "eos_token_id": 1})
    assert hf["eos_token_id"] == 1  # the policy tokenizer's special ids
