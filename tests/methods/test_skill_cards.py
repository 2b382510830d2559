"""SKALD's skill cards: the card shown with a prompt and the measured teacher accuracy equal
reference/distillation.py:skald_skill_card / skald_card_accuracy; the self-teacher's context holds
the card's tokens exactly where a card is shown (the explicit-answer filter withholds it); the
measured accuracy opens the teacher-advantage gate as reference skald_gate says; skald_self is
skald's term on the self-teacher's logits; bad card files and knobs are named. The rollouts of the
policy reading the card (CardAccuracy on the engine) run in tests/trainer/test_method_examples.py."""

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.distillation as rd
from megarl.batch import from_sequences
from megarl.data.tokenizer import CharTokenizer
from megarl.methods.distillation.self_teacher import CONTEXT, ContextKnobs, SelfTeacherContext
from megarl.methods.distillation.skald import GATE, prepare
from megarl.methods.distillation.skill_cards import accuracy_per_prompt, card_for, read_cards
from megarl.objectives.regularisers import REGULARISERS
from megarl.plugin.rounds import RolloutRound
from tests.methods.helpers import load_example

CARDS = {"reverse": "R 123=321 ", "*": "C 45=45 "}


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(["reverse", "copy", "add"]),
    st.sampled_from(["321", "45", " 123 ", "9", "", "7"]),
    st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=3, max_size=3), min_size=1, max_size=4),
)
def test_cards_and_accuracy_match_the_reference(task, answer, rewards):
    assert card_for(CARDS, task, answer) == rd.skald_skill_card(CARDS, task, answer)
    flat = [x for row in rewards for x in row]
    got = accuracy_per_prompt(flat, [3] * len(rewards), 0.5)
    assert got == rd.skald_card_accuracy(torch.tensor(rewards), 0.5).tolist()


def test_the_filter_withholds_cards_that_hold_the_answer():
    assert card_for(CARDS, "reverse", "321") is None and card_for(CARDS, "reverse", "704") == CARDS["reverse"]
    assert card_for(CARDS, "add", "45") is None and card_for({"add": "x"}, "copy", "1") is None
    assert card_for(CARDS, "copy", "") == CARDS["*"]  # an empty answer filters nothing


def test_the_self_teacher_reads_the_card_where_it_is_shown(tmp_path):
    f = tmp_path / "cards.jsonl"
    f.write_text('{"task": "reverse", "card": "R 123=321 "}\n')
    tok = CharTokenizer("0123456789+=RC ")
    rows = [SimpleNamespace(task="reverse"), SimpleNamespace(task="copy"), SimpleNamespace(task="reverse")]
    k = ContextKnobs(source="skill_card", cards=str(f), when="all", max_tokens=12)
    proc = SelfTeacherContext(tok, k, SimpleNamespace(rows=rows))
    r = RolloutRound(
        prompts=["R 407=", "C 11=", "R 123="],
        answers=["704", "11", "321"],  # prompt 3's answer is in the card: withheld
        uids=[0, 1, 2],
        prompt_ids=[tok.encode(p) for p in ("R 407=", "C 11=", "R 123=")],
        response_ids=[[3]] * 6,
        texts=["1"] * 6,
        dims={},
        scalar=torch.zeros(6),
        n=2,
        step=1,
        round=0,
        correct=torch.zeros(6, dtype=torch.bool),
    )
    out = asyncio.run(proc.process(r)).extras[CONTEXT]
    card = [float(t) for t in tok.encode("R 123=321 ", bos=False)]
    assert (
        out[0][: len(card)] == card and out[1] == out[0] and all(math.isnan(x) for x in out[0][len(card) :])
    )
    assert all(math.isnan(x) for row in out[2:] for x in row)  # no card for copy; the filtered one
    with pytest.raises(ValueError, match="cards"):
        ContextKnobs(source="skill_card").check()
    with pytest.raises(ValueError, match=r"\{answer\} is refused"):
        ContextKnobs(source="skill_card", cards=str(f), template="{answer}{solution}").check()


def test_bad_card_files_are_named(tmp_path):
    f = tmp_path / "c.jsonl"
    for text, msg in [
        ('{"task": "a", "card": "x"}\nnot json\n', "line 2: not JSON"),
        ('{"task": "a"}\n', "line 1: expected"),
        ('{"task": "a", "card": "x"}\n{"task": "a", "card": "y"}\n', "line 2: task 'a' has a card"),
        ("\n", "has no card"),
    ]:
        f.write_text(text)
        with pytest.raises(ValueError, match=msg):
            read_cards(f)
    with pytest.raises(ValueError, match="is not a file"):
        read_cards(tmp_path / "missing.jsonl")


def test_measured_accuracy_opens_the_gate_as_the_reference_says():
    b = from_sequences([[1]] * 4, [[2, 3]] * 4, [0, 0, 1, 1], rewards=[0.0, 1.0, 0.0, 0.0])
    b.extras = {"teacher_acc": torch.tensor([0.75, 0.75, 0.0, 0.0], dtype=torch.float64)}
    reg = {"gate": "teacher_advantage", "margin": 0.1}
    g = prepare(b, None, **reg).extras[GATE]
    want = rd.skald_gate(b.rewards, b.group_ids, "teacher_advantage", b.extras["teacher_acc"], 0.1)
    assert g.tolist() == want.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_skald_self_is_skalds_term_on_the_self_teachers_logits():
    assert REGULARISERS.get("skald_self") is REGULARISERS.get("skald")
    assert REGULARISERS.info("skald_self").batch_inputs == ("self_teacher_logits",)
    cfg = load_example("skald-cards")
    assert cfg["inputs"]["self_teacher_context"]["source"] == "skill_card"
    assert read_cards(cfg["inputs"]["self_teacher_context"]["cards"])  # the example's file is valid
