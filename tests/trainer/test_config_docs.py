"""docs/configuration.md is generated from the config dataclasses and must stay in sync with them."""

from pathlib import Path

from megarl.trainer import config_docs
from megarl.trainer.config import TrainConfig
from megarl.trainer.config_sections import yaml_fields

DOC = Path(__file__).parents[2] / "docs" / "configuration.md"


def test_every_key_has_a_meaning():
    assert config_docs.missing_meanings() == []


def test_docs_configuration_md_is_in_sync():
    want = config_docs.render()
    assert DOC.read_text() == want, (
        "docs/configuration.md is stale: run `python -m megarl.trainer.config_docs > docs/configuration.md`"
    )


def test_every_section_and_key_is_listed():
    text = DOC.read_text()
    for f in yaml_fields(TrainConfig):
        assert f"## `{f.name}`" in text
    for name in config_docs.contributed_sections():  # with their owner's text
        assert f"## `{name}`" in text
    assert "## `sections`" not in text and "environment.chosen" not in text
    for key in (
        "async_loop.max_staleness",
        "async_loop.partial_rollout",
        "data.chat_template",
        "rollout.launch",
        "logging.progress",
        "reward.functions[].kind",
        "schedule.old_logprobs",
        "teacher.hf_dir",
        "environment.after_review",
        "environment.reflect_anneal_steps",
    ):
        assert f"| `{key}` |" in text, key
    assert "'math_verify'" in text
