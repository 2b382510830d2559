"""``megarl proxy compare`` refuses bad input before any training starts (fast: no model)."""

import json
from pathlib import Path

import pytest

from megarl.proxy.compare import CompareError, check_inputs, main

RECIPE = str(Path(__file__).parent / "recipe.yaml")
CFG = {
    "model_type": "qwen3_moe",
    "vocab_size": 24,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}


def hf_dir(path: Path, **over) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**CFG, **over}))
    (path / "model.safetensors").write_bytes(b"")
    return str(path)


def test_compare_checks_recipe_models_and_steps_first(tmp_path, capsys):
    orig, proxy = hf_dir(tmp_path / "o"), hf_dir(tmp_path / "p", num_experts=4)
    shapes = check_inputs(RECIPE, orig, proxy, 3, [])
    assert shapes["proxy"]["num_experts"] == 4
    with pytest.raises(CompareError, match="--steps 0"):
        check_inputs(RECIPE, orig, proxy, 0, [])
    with pytest.raises(CompareError, match="unknown key rollout.nn"):
        check_inputs(RECIPE, orig, proxy, 3, ["rollout.nn=2"])
    with pytest.raises(CompareError, match=r"--proxy .*/nope: no config.json"):
        check_inputs(RECIPE, orig, str(tmp_path / "nope"), 3, [])
    wide = hf_dir(tmp_path / "w", hidden_size=128, num_experts=4)
    with pytest.raises(
        CompareError,
        match="not a proxy of --original: model .*/w does not fit the original: "
        "hidden_size: original 64, model 128",
    ):
        check_inputs(RECIPE, orig, wide, 3, [])
    empty = tmp_path / "e"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(CFG))
    with pytest.raises(CompareError, match="no \\*.safetensors"):
        check_inputs(RECIPE, str(empty), proxy, 3, [])
    assert (
        main(
            [
                "--config",
                RECIPE,
                "--original",
                orig,
                "--proxy",
                wide,
                "--steps",
                "2",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    assert "not a proxy of --original" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written
