"""Numbers written as YAML 1.1 leaves them (``1e-4`` is a string there) are numbers in knob mappings
too: estimator knobs, reward-shaping knobs and knob dataclasses (``inputs.*``, ``method.*``)."""

from dataclasses import dataclass

import pytest

from megarl.plugin.knobs import Knobs, build_knobs, check_call_knobs


def _estimator(batch, eps: float = 1e-6, steps: int = 3, on: bool = True):
    return eps, steps, on


@dataclass
class _K(Knobs):
    lr: float = 1e-3
    epochs: int = 1


def test_a_number_spelled_as_a_string_is_a_float_for_float_knobs():
    knobs = {"eps": "1e-4"}
    check_call_knobs(_estimator, knobs, "advantage", "estimator 'x'", skip=("batch",))
    assert knobs == {"eps": 1e-4} and isinstance(knobs["eps"], float)
    k = build_knobs(_K, {"lr": "2.5E-3"}, "inputs.values")
    assert k.lr == 2.5e-3


@pytest.mark.parametrize("raw", [{"steps": "3"}, {"on": "1"}, {"eps": "fast"}])
def test_other_strings_stay_refused(raw):
    with pytest.raises(ValueError, match="advantage."):
        check_call_knobs(_estimator, dict(raw), "advantage", "estimator 'x'", skip=("batch",))


def test_integer_dataclass_knobs_stay_strict():
    with pytest.raises(ValueError, match=r"inputs.values.epochs='2' must be a number"):
        build_knobs(_K, {"epochs": "2"}, "inputs.values")


def test_the_trainer_config_takes_string_numbers_in_estimator_and_input_knobs():
    from pathlib import Path

    from megarl.trainer.config import from_dict
    from megarl.trainer.config_layers import read_layered_config

    d = read_layered_config(Path(__file__).parents[2] / "examples" / "methods" / "ppo-critic.yaml")
    d["advantage"]["lam"] = "9.5e-1"
    d["inputs"]["values"]["lr"] = "1e-4"
    cfg = from_dict(d)
    assert cfg.advantage.knobs["lam"] == 0.95
    from megarl.plugin.inputs import provider_for
    from megarl.trainer.method_runtime import provider_knobs

    assert provider_knobs(cfg, provider_for("values")).lr == 1e-4  # the critic's knobs, as it gets them
