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
    """The quickstart config with the example's sections: advantage/objective replaced, the other
    sections (reward.shaping, reward.functions, inputs) merged key by key."""
    d = yaml.safe_load(QUICKSTART.read_text())
    ex = yaml.safe_load((ROOT / "examples" / "methods" / f"{name}.yaml").read_text())
    for k, v in ex.items():
        if k in ("advantage", "objective"):
            d[k] = v
        else:
            d.setdefault(k, {}).update(v)
    return d


@pytest.mark.parametrize("name", FAMILY2)
def test_trainer_config_loader_accepts_the_example(name):
    cfg = from_dict(spliced(name))
    assert (
        cfg.advantage.estimator
        == yaml.safe_load((ROOT / "examples" / "methods" / f"{name}.yaml").read_text())["advantage"][
            "estimator"
        ]
    )
