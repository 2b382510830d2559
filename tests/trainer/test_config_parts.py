"""Config sections and keys contributed by the packages that own them (megarl/plugin/config_parts.py):
the loader, the checks, the ranges, the resolved config and the reference take them without the
trainer naming them; bad keys are named with the allowed ones."""

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from megarl.plugin.config_parts import KEYS, POSITIVE, SECTIONS, register_section, section_of
from megarl.plugin.teacher_config import TeacherConfig, teacher_config
from megarl.rollout.instructed import InstructedKeys
from megarl.rollout.reflect import ReflectKeys
from megarl.rollout.review import ReviewKeys
from megarl.rollout.workflow import WORKFLOWS
from megarl.trainer import config_docs
from megarl.trainer.config import ConfigError, TrainConfig, apply_overrides, from_dict, save_resolved

ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def load(*overrides: str) -> TrainConfig:
    return from_dict(apply_overrides(yaml.safe_load(QUICKSTART.read_text()), list(overrides)))


@dataclass
class ToyConfig:
    """A section a test package contributes."""

    size: int = 2  # how many toys
    label: str = "toy"  # what the toys are called


def _check_toy(cfg) -> None:
    if section_of(cfg, "toy", ToyConfig).label == "bad":
        raise ValueError("toy.label='bad' is refused by the toy package")


@pytest.fixture
def toy():
    register_section("toy", ToyConfig, check=_check_toy, ranges={"size": POSITIVE})
    yield
    SECTIONS.pop("toy")


def test_a_contributed_section_loads_checks_and_is_documented(toy):
    cfg = load("toy.size=5")
    assert section_of(cfg, "toy", ToyConfig) == ToyConfig(size=5)
    with pytest.raises(ConfigError, match="unknown key toy.sizes; allowed in toy: size, label"):
        load("toy.sizes=5")
    with pytest.raises(ConfigError, match="toy.size=0 must be > 0"):  # its range
        load("toy.size=0")
    with pytest.raises(ConfigError, match="toy.size='x' must be an integer"):  # its types
        load("toy.size=x")
    with pytest.raises(ConfigError, match="toy.label='bad' is refused by the toy package"):  # its check
        load("toy.label=bad")
    with pytest.raises(ConfigError, match="unknown key toys; allowed in the top level: .*teacher, toy"):
        load("toys.size=1")
    text = config_docs.render()
    assert "## `toy`\n\nA section a test package contributes." in text
    assert "Contributed by `tests.trainer.test_config_parts`" in text
    assert "| `toy.size` | int | > 0 | `2` | how many toys |" in text
    assert "toy.label" not in config_docs.missing_meanings()
    with pytest.raises(ValueError, match="already contributed by tests.trainer.test_config_parts"):
        register_section("toy", TeacherConfig)


def test_the_teacher_section_is_its_owners(tmp_path):
    cfg = load("teacher.hf_dir=runs/t", "teacher.max_concurrency=4")
    assert teacher_config(cfg) == TeacherConfig(hf_dir="runs/t", max_concurrency=4)
    with pytest.raises(ConfigError, match="unknown key teacher.hf_dirr; allowed in teacher: hf_dir, source"):
        load("teacher.hf_dirr=x")
    with pytest.raises(ConfigError, match="teacher.max_concurrency=0 must be > 0"):
        load("teacher.max_concurrency=0")
    with pytest.raises(ConfigError, match="teacher.engine=vllm needs teacher.urls"):
        load("teacher.source=engine", "objective.distill=sampled_reverse_kl")
    again = from_dict(yaml.safe_load(save_resolved(cfg, tmp_path).read_text()))
    assert (
        again == cfg
        and yaml.safe_load((tmp_path / "config.resolved.yaml").read_text())["teacher"]["hf_dir"] == "runs/t"
    )
    built = TrainConfig()  # a config built in code: the defaults, and a change sticks
    teacher_config(built).hf_dir = "x"
    assert teacher_config(built).hf_dir == "x"


def test_workflow_keys_exist_only_with_their_workflow(tmp_path):
    cfg = load("environment.name=review", "environment.after_review=' again {prompt}'")
    assert cfg.environment.chosen == ReviewKeys(after_review=" again {prompt}")
    with pytest.raises(
        ConfigError,
        match=r"unknown key environment.after_review; allowed in environment: name, max_turns, feedback "
        r"\(environment.after_review needs environment.name: review\)",
    ):
        load("environment.after_review=x")
    with pytest.raises(
        ConfigError,
        match=r"allowed in environment: name, max_turns, feedback, after_review \(environment.reflect_frac",
    ):
        load("environment.name=review", "environment.reflect_frac=0.5")
    assert load(
        "environment.name=instructed", "environment.instructions=[' a', ' b']"
    ).environment.chosen == (InstructedKeys(instructions=[" a", " b"]))
    with pytest.raises(ConfigError, match=r"environment.instructions needs environment.name: instructed"):
        load("environment.instructions=[' a']")
    with pytest.raises(ConfigError, match=r"environment.instructions\[1\]='': a non-empty text expected"):
        load("environment.name=instructed", "environment.instructions=[' a', '']")
    with pytest.raises(ConfigError, match="environment.after_review='{x}': only {prompt} may be used"):
        load("environment.name=review", "environment.after_review='{x}'")
    with pytest.raises(ConfigError, match=r"environment.reflect_frac=2.0 must be in \[0, 1\]"):
        load("environment.name=reflect", "environment.reflect_frac=2")
    with pytest.raises(ConfigError, match="environment.reflect_template='{x}' must format with"):
        load("environment.name=reflect", "environment.reflect_template='{x}'")
    cfg = load("environment.name=reflect", "environment.reflect_anneal_steps=3")
    assert cfg.environment.chosen == ReflectKeys(reflect_anneal_steps=3)
    resolved = yaml.safe_load(save_resolved(cfg, tmp_path).read_text())["environment"]
    assert resolved["reflect_anneal_steps"] == 3 and "chosen" not in resolved
    assert from_dict(yaml.safe_load((tmp_path / "config.resolved.yaml").read_text())) == cfg
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert "| `environment.after_review` | str |  | `' {prompt}'` | review: the observation after" in text
    assert "| `environment.reflect_frac` | float | in [0, 1] | `0.5` | reflect: share of" in text


USER_PACKAGE = """
from dataclasses import dataclass

from megarl.plugin.config_parts import POSITIVE, register_keys, register_section, section_of
from megarl.plugin.spec import MethodParts, MethodSpec
from megarl.rollout.workflow import WORKFLOWS, SingleTurn


@dataclass
class LimitsConfig:
    ceiling: float = 1.0  # the largest value the package allows


@dataclass
class EchoKeys:
    echo_times: int = 1  # how often the user package's workflow repeats an answer


register_section("limits", LimitsConfig, ranges={"ceiling": POSITIVE})
WORKFLOWS.add("user_echo", SingleTurn)
register_keys("environment", "user_echo", EchoKeys)
SPEC = MethodSpec(
    name="limits", summary="a user's package", provenance="reconstructed", build=lambda c, k: MethodParts()
)
"""


def test_a_users_package_contributes_its_section_and_keys_when_its_method_is_imported(
    tmp_path, monkeypatch, request
):
    """A method outside megarl (``method.import``) registers config parts at import: they load,
    range-check and are refused without the package, like the built-in ones."""
    (tmp_path / "user_limits_pkg.py").write_text(USER_PACKAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    # what the package adds is removed after the test (other tests see the built-in registry only)
    request.addfinalizer(lambda: sys.modules.pop("user_limits_pkg", None))
    request.addfinalizer(lambda: SECTIONS.pop("limits", None))
    request.addfinalizer(lambda: KEYS["environment"].pop("user_echo", None))
    monkeypatch.setattr(WORKFLOWS, "_items", dict(WORKFLOWS._items))
    monkeypatch.setattr(WORKFLOWS, "_info", dict(WORKFLOWS._info))
    with pytest.raises(ConfigError, match="unknown .*limits"):
        load("limits.ceiling=2.0")
    cfg = load("method.import=user_limits_pkg:SPEC", "limits.ceiling=2.5")
    assert type(cfg.sections["limits"]).__name__ == "LimitsConfig" and cfg.sections["limits"].ceiling == 2.5
    with pytest.raises(ConfigError, match=r"limits.ceiling=-1.0 must be"):
        load("method.import=user_limits_pkg:SPEC", "limits.ceiling=-1.0")
    cfg = load("method.import=user_limits_pkg:SPEC", "environment.name=user_echo", "environment.echo_times=3")
    assert cfg.environment.chosen.echo_times == 3
    with pytest.raises(ConfigError, match=r"environment.echo_times needs environment.name: user_echo"):
        load("method.import=user_limits_pkg:SPEC", "environment.echo_times=3")
