"""CEDAR-GRPO: composite reward equals reference/reward_shaping.py; the method's
invariants; judge plumbing through the rollout engine interface with timeout and malformed-output
containment."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.reward_shaping as rr
from megarl.rewards.shaping import build_reward_shaping
from megarl.rewards.shaping.cedar import CEDARReward, substring_coverage
from megarl.rewards.shaping.judge import LLMJudge, parse_score, parse_verdicts
from megarl.rollout.types import EngineDeadError
from tests.methods.helpers import load_example
from tests.methods.judge_engines import ScriptedJudgeEngine, tiny_embedded_judge, tiny_tokenizer

ROWS = st.lists(
    st.tuples(st.integers(0, 1), st.lists(st.integers(0, 1), max_size=4), st.floats(-0.5, 1.5)),
    min_size=1,
    max_size=6,
)


def _tensors(rows):
    M = max([len(c) for _, c, _ in rows] + [1])
    cov = torch.zeros(len(rows), M, dtype=torch.float64)
    valid = torch.zeros(len(rows), M, dtype=torch.bool)
    for i, (_, c, _) in enumerate(rows):
        cov[i, : len(c)] = torch.tensor(c, dtype=torch.float64)
        valid[i, : len(c)] = True
    return (
        torch.tensor([a for a, _, _ in rows], dtype=torch.float64),
        cov,
        valid,
        torch.tensor([d for _, _, d in rows], dtype=torch.float64),
    )


@settings(max_examples=30)
@given(
    ROWS,
    st.sampled_from([0.0, 0.5, 1.0]),
    st.sampled_from([0.0, 0.3]),
    st.sampled_from(["none", "correct_only", "reduced"]),
)
def test_matches_reference_and_is_bounded(rows, lc, ld, gate):
    a, cov, valid, d = _tensors(rows)
    R = CEDARReward(lc, ld, gate, 0.5)(a, cov, valid, d)
    ref = rr.cedar_reward(
        [x for x, _, _ in rows], [c for _, c, _ in rows], [x for _, _, x in rows], lc, ld, gate, 0.5
    )
    torch.testing.assert_close(R, ref)
    assert bool(((R >= 0) & (R <= 1 + lc + ld + 1e-12)).all())
    assert torch.equal(
        CEDARReward(0.0, 0.0, gate)(a, cov, valid, d), a
    )  # λ = 0: correctness-only GRPO reward


def test_coverage_is_monotone_in_cited_evidence():
    ev = ["the window was broken", "muddy footprints", "the dog did not bark"]
    rewards = []
    for k in range(4):
        y = "Explanation: " + "; ".join(ev[:k])
        cov = torch.tensor([substring_coverage(y, ev)], dtype=torch.float64)
        rewards.append(
            float(CEDARReward()(torch.ones(1), cov, torch.ones(1, 3, dtype=torch.bool), torch.zeros(1)))
        )
    assert rewards == sorted(rewards) and rewards[0] < rewards[-1]


def test_parsers_read_good_replies_and_reject_bad_ones():
    assert parse_score("reasoning... Score: 0.75") == 0.75
    assert parse_verdicts("1: yes\n2. no\n3) YES", 3) == [1, 0, 1]
    with pytest.raises(ValueError, match="no verdict for item"):
        parse_verdicts("1: yes", 2)
    with pytest.raises(ValueError, match="outside"):
        parse_score("score: 7")


def test_judge_plumbing_through_an_engine_with_containment():
    tok = tiny_tokenizer()

    def reply(prompt):
        if "accounts for it" in prompt:  # coverage question
            return "1: yes\n2: no" if "alpha" in prompt else "I cannot tell"  # second response: malformed
        if "Dead" in prompt:
            return EngineDeadError("judge crashed")
        if "slow" in prompt:
            return ("sleep", 5.0)
        return "score: 0.8"

    engine = ScriptedJudgeEngine(tok, reply)
    judge = LLMJudge(engine, tok, timeout_s=0.5)
    cedar = CEDARReward(direction_fallback=0.0)
    responses = ["alpha explanation", "beta slow", "gamma Dead"]
    evidence = [["alpha", "omega"], ["beta"], []]
    import asyncio

    cov, valid, d = asyncio.run(cedar.judge_inputs(judge, responses, evidence))
    assert cov[0].tolist() == [1.0, 0.0]  # judged
    assert cov[1, 0] == 1.0  # malformed coverage reply: substring fallback
    assert d.tolist() == [0.8, 0.0, 0.0]  # timeout and engine error: fallback
    assert judge.stats.timeouts == 1 and judge.stats.engine_errors >= 1 and judge.stats.malformed >= 1
    R = cedar(torch.tensor([1.0, 0.0, 0.0]), cov, valid, d)
    assert bool(torch.isfinite(R).all())


@pytest.mark.slow
def test_real_tiny_model_judge_output_is_contained(tmp_path):
    engine = tiny_embedded_judge(tmp_path)
    judge = LLMJudge(engine, engine.tokenizer, timeout_s=60.0)
    from megarl.rollout.types import SamplingParams

    judge.sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    res = judge.ask_many_sync(
        ["Rate this: score?", "Is 2+2=4? Answer score:"], lambda t: parse_score(t, 0.0, 1.0)
    )
    for r in res:  # random weights: either a contained failure or a parsed score in range
        assert (r.error is not None and r.value is None) or 0.0 <= r.value <= 1.0
    assert judge.stats.calls == 2


def test_bad_knobs_and_example():
    with pytest.raises(ValueError, match="gate"):
        CEDARReward(gate="sometimes")
    c = build_reward_shaping(load_example("cedar-grpo")["reward"])
    assert isinstance(c, CEDARReward) and c.gate == "reduced"
