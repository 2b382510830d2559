"""LLMZero: the search tree equals reference/allocation.py's search node for node, UCT selection is
deterministic given the statistics, the compute spent never passes the cap, with a random proposer
the search is random search, a stopped search resumes from its saved tree without charging a stage
twice, and the diagnoser, proposers and in-run step hook behave as documented.
"""

import json
import random
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.methods.allocation.llmzero import LLMZeroKnobs, StageDiagnosis
from megarl.methods.allocation.llmzero_agent import (
    LLMProposer,
    RandomProposer,
    RuleProposer,
    diagnose,
    parse_changes,
)
from megarl.methods.allocation.llmzero_driver import override_args, search
from megarl.methods.allocation.llmzero_tree import SearchTree
from megarl.plugin.knobs import build_knobs
from reference import allocation as ref

FAST = settings(max_examples=15, deadline=None)
SPACE = {"optimizer.lr": [1e-4, 3e-4, 1e-3], "rollout.max_new_tokens": [6, 8, 12], "rollout.n": [4, 8]}
FIELDS = ("id", "parent", "depth", "config", "children", "visits", "value_sum", "value", "done")


def _value(cfg: dict, depth: int, seed: int) -> float:
    """A deterministic stand-in for a stage's validation value (a function of config and depth)."""
    return round(random.Random(f"{seed}-{json.dumps(cfg, sort_keys=True)}-{depth}").random(), 6)


def _cost(seed: int):
    return lambda cfg: 1 + random.Random(f"c{seed}-{json.dumps(cfg, sort_keys=True)}").randrange(3)


def _both(seed, k, c, depth, budget, capacity):
    """The plugin's tree and the reference's, from the same proposer, values and costs."""
    propose = lambda node, m: ref.llmzero_random_configs(  # noqa: E731
        SPACE, m, seed, node["id"] if isinstance(node, dict) else node.id
    )
    nodes, spent = ref.llmzero_search(
        propose,
        lambda n: _value(n["config"], n["depth"], seed),
        _cost(seed),
        budget,
        k,
        c,
        depth,
        capacity,
    )
    tree = SearchTree(k, c, depth, budget, capacity)
    search(tree, lambda n, p: _value(n.config, n.depth, seed), propose, _cost(seed), log=lambda *_: None)
    return tree, nodes, spent


@FAST
@given(
    seed=st.integers(0, 10**6),
    k=st.integers(1, 3),
    c=st.floats(0, 2),
    depth=st.integers(1, 3),
    budget=st.integers(0, 25),
    prior=st.booleans(),
)
def test_tree_equals_reference_and_stays_in_budget(seed, k, c, depth, budget, prior):
    capacity = ("rollout.max_new_tokens", "rollout.n") if prior else ()
    tree, nodes, spent = _both(seed, k, c, depth, budget, capacity)
    got = [{f: getattr(n, f) for f in FIELDS} for n in tree.nodes]
    want = [{f: n[f] for f in FIELDS} for n in nodes]
    if budget < 1:  # not even the root fits: the plugin tree holds its untrained root only
        want = [{**want[0]}]
    assert got == want
    assert tree.spent == spent <= budget
    assert tree.spent == sum(_cost(seed)(n.config) for n in tree.nodes if n.charged)
    for n in tree.nodes:  # the capacity prior: a child never lowers a capacity key
        if prior and n.parent is not None:
            par = tree.nodes[n.parent].config
            assert all(n.config[key] >= par[key] for key in capacity if key in par)


@FAST
@given(seed=st.integers(0, 10**6), c=st.floats(0, 3))
def test_uct_selection_is_deterministic_given_the_statistics(seed, c):
    tree, _, _ = _both(seed, 3, c, 2, 14, ())
    again = SearchTree.from_dict(json.loads(json.dumps(tree.to_dict())))
    a, b = tree.select(), again.select()
    assert (a is None and b is None) or a.id == b.id
    for n in tree.nodes:
        if n.parent is not None:
            p = tree.nodes[n.parent]
            assert tree.uct(n, p) == pytest.approx(ref.llmzero_uct(n.value_sum, n.visits, p.visits, c))
    # ties go to the lowest id: two fresh children of the root
    t = SearchTree(2, c, 1, 10)
    search(t, lambda n, p: 0.5, lambda n, m: [{"optimizer.lr": 1e-4}, {"optimizer.lr": 1e-3}], lambda cfg: 1)
    assert t.nodes[1].visits == t.nodes[2].visits and t.uct(t.nodes[1], t.nodes[0]) == t.uct(
        t.nodes[2], t.nodes[0]
    )


def test_random_proposer_gives_random_search():
    """One level, k = the budget: the children are random search's draws, the best is their max."""
    budget, seed = 6, 3
    tree = SearchTree(budget, 1.0, 1, budget + 1)
    prop = RandomProposer(SPACE, seed)
    values = {}

    def run(node, parent):
        values[node.id] = _value(node.config, node.depth, seed)
        return values[node.id]

    search(tree, run, lambda n, m: prop(n, m), lambda cfg: 1, log=lambda *_: None)
    draws = ref.llmzero_random_configs(SPACE, budget, seed, 0)
    assert [n.config for n in tree.nodes[1:]] == draws
    assert tree.spent == budget + 1 and tree.nodes[0].done
    assert tree.best().value == max(values.values())


def test_a_stopped_search_resumes_without_charging_a_stage_twice():
    calls = []

    def run(node, parent):
        calls.append(node.id)
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed while training node 2
        return _value(node.config, node.depth, 0)

    propose = lambda n, m: ref.llmzero_random_configs(SPACE, m, 0, n.id)  # noqa: E731
    tree = SearchTree(2, 0.5, 2, 8)
    with pytest.raises(KeyboardInterrupt):
        search(tree, run, propose, lambda cfg: 1, log=lambda *_: None)
    saved = json.loads(json.dumps(tree.to_dict()))
    assert saved["spent"] == 3
    resumed = SearchTree.from_dict(saved)
    search(resumed, run, propose, lambda cfg: 1, log=lambda *_: None)
    assert calls[2:4] == [2, 2]  # node 2 trained again first
    nodes, spent = ref.llmzero_search(  # the same tree as an uninterrupted search
        lambda n, m: ref.llmzero_random_configs(SPACE, m, 0, n["id"]),
        lambda n: _value(n["config"], n["depth"], 0),
        lambda cfg: 1,
        8,
        2,
        0.5,
        2,
    )
    assert [n.config for n in resumed.nodes] == [n["config"] for n in nodes]
    assert [n.value_sum for n in resumed.nodes] == [n["value_sum"] for n in nodes]
    assert resumed.spent == spent == 7 and resumed.nodes[0].done  # k=2, depth 2: 7 nodes, then done


def test_diagnoser_and_rule_proposer():
    recs = [
        {"reward/mean": 0.3, "train/entropy": 0.2, "train/kl": 0.5, "rollout/truncated_frac": 0.6},
        {"reward/mean": 0.3, "train/entropy": 0.1, "train/kl": 0.4, "rollout/truncated_frac": 0.5},
    ]
    flags = diagnose(recs)
    assert flags == {
        "entropy_collapse": True,
        "kl_high": True,
        "truncated": True,
        "zero_var": False,
        "plateau": True,
    }
    space = {**SPACE, "rollout.temperature": [0.8, 1.0, 1.2], "objective.kl_coef": [0.0, 0.001, 0.01]}
    base = {
        "optimizer.lr": 3e-4,
        "rollout.max_new_tokens": 8,
        "rollout.temperature": 1.0,
        "objective.kl_coef": 0.001,
    }

    class N:
        id, config = 4, {}

    props = RuleProposer(space, base, 0)(N(), 4, flags)
    assert props[0] == {
        "rollout.max_new_tokens": 12,
        "rollout.temperature": 1.2,
        "optimizer.lr": 1e-4,
        "objective.kl_coef": 0.01,
    }
    assert {"rollout.max_new_tokens": 12} in props and len(props) == 4
    assert len({json.dumps(p, sort_keys=True) for p in props}) == 4  # distinct
    assert diagnose([]) == dict.fromkeys(flags, False)


def test_parse_changes_and_llm_fallback_on_a_real_engine():
    assert parse_changes('x {"optimizer.lr": 0.001} y', SPACE) == {"optimizer.lr": 1e-3}
    assert parse_changes('{"optimizer.lr": 5}', SPACE) is None  # outside the space
    assert parse_changes('{"schedule.steps": 9}', SPACE) is None  # not a search key
    assert parse_changes("no json", SPACE) is None
    from megarl.data.tokenizer import CharTokenizer
    from megarl.rollout.embedded import EmbeddedEngine, hf_model_from_config

    tok = CharTokenizer(string.ascii_letters + string.digits + string.punctuation + " \n")
    hf = {"model_type": "qwen3", "vocab_size": tok.vocab_size, "hidden_size": 16, "intermediate_size": 32}
    hf.update(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    hf.update(max_position_embeddings=512, tie_word_embeddings=False)
    eng = EmbeddedEngine(hf_model_from_config(hf), eos_token_ids=[tok.eos_id])

    class N:
        id, config = 1, {}

    rule = RuleProposer(SPACE, {}, 0)
    agent = LLMProposer(eng, tok, SPACE, rule, seed=0)
    out = agent(N(), 2, {"plateau": True})
    # a random-weight LM writes no usable JSON: every answer fell back to the rule proposer's
    assert agent.answers == 2 and agent.fallbacks == 2 and out == rule(N(), 2, {"plateau": True})


def test_stage_hook_knobs_and_overrides():
    hook = StageDiagnosis()
    m1 = hook.after_step(1, {"train/entropy": 1.5, "train/kl": 0.01})
    m2 = hook.after_step(2, {"train/entropy": 0.01, "train/kl": 0.9})
    assert m1 == {"llmzero/entropy_collapse": 0.0, "llmzero/kl_high": 0.0}
    assert m2 == {"llmzero/entropy_collapse": 0.0, "llmzero/kl_high": 1.0}  # means over the window
    fresh = StageDiagnosis()
    fresh.load_state_dict(hook.state_dict())
    assert fresh.after_step(3, {"train/entropy": 0.0}) == hook.after_step(3, {"train/entropy": 0.0})
    assert override_args({"optimizer.lr": 0.001, "x.name": "a"}) == ["optimizer.lr=0.001", 'x.name="a"']
    with pytest.raises(ValueError, match="proposer=llm needs llm_dir"):
        build_knobs(LLMZeroKnobs, {"proposer": "llm"}, "method")
    with pytest.raises(ValueError, match=r"space.lr: not an override key"):
        build_knobs(LLMZeroKnobs, {"space": {"lr": [1]}}, "method")
