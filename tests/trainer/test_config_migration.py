"""A config written for an older megarl gets a message naming where each removed key went."""

from pathlib import Path

import pytest
import yaml

from megarl.trainer.config import ConfigError, from_dict, load_config

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart.yaml"


def base() -> dict:
    return yaml.safe_load(QUICKSTART.read_text())


@pytest.mark.parametrize(
    "credit, moves",
    [
        ({"answer_pattern": "(\\d+)"}, ["credit.answer_pattern -> inputs.answer_checkpoints.pattern"]),
        (
            {"rrpo": {"anchors": 2, "tau": 0.5}},
            [
                "credit.rrpo.anchors -> inputs.rrpo_scores.anchors",
                "credit.rrpo.tau -> inputs.rrpo_scores.tau",
            ],
        ),
        (
            {"answer_pattern": "x", "rrpo": {"head_steps": 3}},
            [
                "credit.answer_pattern -> inputs.answer_checkpoints.pattern",
                "credit.rrpo.head_steps -> inputs.rrpo_scores.head_steps",
            ],
        ),
    ],
)
def test_removed_credit_section_names_the_new_keys(credit, moves):
    d = dict(base(), credit=credit)
    with pytest.raises(ConfigError) as e:
        from_dict(d)
    msg = str(e.value)
    assert msg.startswith("the credit section was removed")
    for move in moves:
        assert move in msg
    assert "unknown key" not in msg


def test_empty_or_odd_credit_section_lists_every_move():
    for credit in (None, {}, {"answer_patern": "x"}):
        with pytest.raises(ConfigError) as e:
            from_dict(dict(base(), credit=credit))
        msg = str(e.value)
        assert "credit.answer_pattern -> inputs.answer_checkpoints.pattern" in msg
        for k in ("anchors", "positive_prompt", "negative_prompt", "head_dim", "head_hidden", "head_steps"):
            assert f"credit.rrpo.{k} -> inputs.rrpo_scores.{k}" in msg
    with pytest.raises(ConfigError, match="credit.answer_patern is no key of the removed credit section"):
        from_dict(dict(base(), credit={"answer_patern": "x"}))


def test_the_override_form_gets_the_same_message():
    with pytest.raises(ConfigError, match="credit.answer_pattern -> inputs.answer_checkpoints.pattern"):
        load_config(QUICKSTART, ["credit.answer_pattern=(\\d+)"])


def test_the_new_keys_are_accepted_where_the_message_points():
    d = dict(base(), method={"name": "dash"}, inputs={"answer_checkpoints": {"pattern": "(\\d+)"}})
    assert from_dict(d).inputs == {"answer_checkpoints": {"pattern": "(\\d+)"}}
