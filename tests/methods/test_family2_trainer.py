"""Family-2 example configs and the trainer's config loader: every example's advantage/objective
sections are accepted when spliced into the quickstart config. (Each example's 2-step training run,
dense and MoE, is tests/trainer/test_method_examples.py.)"""

from pathlib import Path

import pytest
import yaml

from megarl.trainer.config import from_dict

ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
FAMILY2 = [
    "softmax-grpo",
    "taco",
    "gepo",
    "dash",
    "gigpo",
    "pgpo",
    "rspo",
    "reward-floor",
    "amrp",
    "rubric-dropout",
    "cedar-grpo",
    "care",
    "rrpo",
]


def spliced(name: str) -> dict:
    """The example laid over the quickstart (its ``base:``), as ``megarl train`` reads it."""
    from megarl.trainer.config_layers import read_layered_config

    return read_layered_config(ROOT / "examples" / "methods" / f"{name}.yaml")


@pytest.mark.parametrize("name", FAMILY2)
def test_trainer_config_loader_accepts_the_example(name):
    cfg = from_dict(spliced(name))
    assert (
        cfg.advantage.estimator
        == yaml.safe_load((ROOT / "examples" / "methods" / f"{name}.yaml").read_text())["advantage"][
            "estimator"
        ]
    )
