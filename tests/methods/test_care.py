"""CARE: rubric reward, trigger and pruning equal reference/reward_shaping.py; rubric evolution through
judge/evolver LLM calls on the rollout engine interface (scripted stand-in judge); the method's invariants."""

import asyncio

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.reward_shaping as rr
from megarl.rewards.shaping import build_reward_shaping
from megarl.rewards.shaping.care import CARE, prune, rubric_reward, trigger
from megarl.rewards.shaping.judge import LLMJudge
from tests.methods.helpers import load_example
from tests.methods.judge_engines import ScriptedJudgeEngine, tiny_tokenizer


@settings(max_examples=30)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_reward_matches_reference_and_is_in_unit_interval(B, K, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(B, K, generator=g, dtype=torch.float64)
    w = torch.randint(0, 4, (K,), generator=g).double()
    R = rubric_reward(s, w)
    torch.testing.assert_close(R, rr.care_reward(s, w.tolist()))
    assert bool(((R >= 0) & (R <= 1 + 1e-12)).all())


@settings(max_examples=50)
@given(
    st.floats(0, 1),
    st.floats(0, 1),
    st.floats(0, 1),
    st.lists(st.sampled_from([0.0, 0.1, 0.2, 0.5]), max_size=8),
    st.integers(1, 5),
    st.integers(0, 1),
)
def test_trigger_and_prune_match_reference(rb, ra, p, variances, k_max, protected):
    assert trigger(rb, ra, p) == rr.care_trigger(rb, ra, p)
    protected = min(protected, len(variances))
    kept = prune(torch.tensor(variances, dtype=torch.float64), max(k_max, protected), protected)
    assert kept == rr.care_prune(variances, max(k_max, protected), protected)
    assert len(kept) <= max(k_max, protected)


def _setup(
    reply_pref="winner: A",
    evolver_reply="criterion: cites the primary source",
    anchor_score=0.9,
    best_score=0.2,
    k_max=3,
    evolve=True,
):
    tok = tiny_tokenizer()

    def reply(prompt):
        if "Which response is better" in prompt:
            return reply_pref
        if "Write ONE" in prompt:
            return evolver_reply
        if "Criterion:" in prompt:
            return (
                f"score: {anchor_score}"
                if "ANCHOR" in prompt.split("Response:")[1]
                else f"score: {best_score}"
            )
        return "??"

    engine = ScriptedJudgeEngine(tok, reply)
    care = CARE(k_max=k_max, evolve=evolve)
    care.add_prompt(7, ["is correct", "is concise"], [1.0, 1.0], anchor="ANCHOR answer")
    return care, LLMJudge(engine, tok, timeout_s=5.0), engine


def test_adaptive_branch_adds_a_separating_criterion_and_reads_only_best_and_anchor():
    care, judge, engine = _setup()
    responses = ["resp-one", "resp-two-best", "resp-three"]
    scores = torch.tensor([[0.5, 0.5], [1.0, 1.0], [0.0, 0.5]], dtype=torch.float64)
    R = care.reward(7, scores)
    branch = asyncio.run(care.evolve(7, "Q?", responses, scores, torch.tensor([1.0, 0.5]), judge))
    assert branch == "adaptive"  # R(y+) = 1 >= R(y*) = 0.75 but the judge prefers the anchor
    rub = care.rubrics[7]
    assert rub.criteria[-1] == "cites the primary source" and rub.version == 1
    for prompt in engine.prompts:  # only y+ and the anchor were shown
        assert "resp-one" not in prompt and "resp-three" not in prompt
    assert any("resp-two-best" in p for p in engine.prompts)
    torch.testing.assert_close(R, rr.care_reward(scores, [1.0, 1.0]))  # the group kept one rubric version


def test_chase_rejection_malformed_evolver_and_evolution_off():
    scores = torch.tensor([[0.0, 0.5], [0.5, 0.5]], dtype=torch.float64)
    care, judge, _ = _setup(anchor_score=0.1, best_score=0.6)  # new criterion does not separate: rejected
    assert asyncio.run(care.evolve(7, "Q", ["a", "b"], scores, torch.tensor([1.0, 1.0]), judge)) == "chase"
    assert care.rubrics[7].version == 0 and care.events[-1] == (7, "chase", False)
    care, judge, _ = _setup(evolver_reply="I refuse")
    asyncio.run(care.evolve(7, "Q", ["a", "b"], scores, torch.tensor([1.0, 1.0]), judge))
    assert len(care.rubrics[7].criteria) == 2 and judge.stats.malformed == 1
    care, judge, engine = _setup(evolve=False)
    assert asyncio.run(care.evolve(7, "Q", ["a", "b"], scores, torch.tensor([1.0, 1.0]), judge)) == "none"
    assert engine.prompts == [] and care.rubrics[7].criteria == ["is correct", "is concise"]


def test_rubric_never_exceeds_k_max_and_state_round_trips():
    care, judge, _ = _setup(k_max=3)
    for _step in range(5):
        rub = care.rubrics[7]
        K = len(rub.criteria)
        scores = torch.rand(4, K, dtype=torch.float64)
        scores[1] = 1.0
        care.reward(7, scores)
        asyncio.run(care.evolve(7, "Q", [f"r{i}" for i in range(4)], scores, torch.full((K,), 0.5), judge))
        assert len(care.rubrics[7].criteria) <= 3
    assert care.rubrics[7].version >= 2
    other = CARE(k_max=3)
    other.load_state_dict(care.state_dict())
    assert vars(other.rubrics[7]) == vars(care.rubrics[7]) and other.anchors == care.anchors


def test_example_loads():
    c = build_reward_shaping(load_example("care")["reward"])
    assert isinstance(c, CARE) and c.k_max == 12
