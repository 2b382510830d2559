"""Numbers that would crash the run later or quietly switch something off are refused at load, the
message naming the key and its allowed range; scientific notation is read as a number."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megarl.trainer.config import ConfigError, apply_overrides, from_dict
from megarl.trainer.config_ranges import all_ranges, range_text

ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def load(*overrides: str):
    return from_dict(apply_overrides(yaml.safe_load(QUICKSTART.read_text()), list(overrides)))


@pytest.mark.parametrize(
    "override, key, allowed",
    [
        ("optimizer.lr=-1", "optimizer.lr=-1.0", "> 0"),
        ("optimizer.lr=0", "optimizer.lr=0.0", "> 0"),
        ("optimizer.lr=-1e-4", "optimizer.lr=-0.0001", "> 0"),
        ("optimizer.adam_beta1=2", "optimizer.adam_beta1=2.0", "in [0, 1)"),
        ("optimizer.adam_beta2=1", "optimizer.adam_beta2=1.0", "in [0, 1)"),
        ("optimizer.adam_eps=0", "optimizer.adam_eps=0.0", "> 0"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1", ">= 0"),
        ("optimizer.clip_grad=-1", "optimizer.clip_grad=-1.0", ">= 0 (0 = no clipping)"),
        ("optimizer.lr_warmup_steps=-1", "optimizer.lr_warmup_steps=-1", ">= 0"),
        ("optimizer.min_lr=1", "optimizer.min_lr=1.0", "<= optimizer.lr=0.0003"),
        ("rollout.top_p=0", "rollout.top_p=0.0", "in (0, 1]"),
        ("rollout.top_p=1.5", "rollout.top_p=1.5", "in (0, 1]"),
        ("rollout.top_k=0", "rollout.top_k=0", "-1 (off) or >= 1"),
        ("rollout.max_concurrency=0", "rollout.max_concurrency=0", "> 0"),
        ("rollout.temperature=-0.5", "rollout.temperature=-0.5", ">= 0 (0 = greedy)"),
        ("rollout.max_new_tokens=0", "rollout.max_new_tokens=0", "> 0"),
        ("rollout.server_startup_timeout_s=0", "rollout.server_startup_timeout_s=0.0", "> 0"),
        ("reward.functions=[{name: c, weight: .nan}]", "reward.functions[0].weight=nan", "a finite number"),
        ("reward.functions=[{name: c, weight: .inf}]", "reward.functions[0].weight=inf", "a finite number"),
        ("reward.fallback=-.inf", "reward.fallback=-inf", "a finite number"),
        ("reward.timeout_s=0", "reward.timeout_s=0.0", "> 0"),
        ("reward.judge.temperature=-1", "reward.judge.temperature=-1.0", ">= 0"),
        ("schedule.eval_samples=-4", "schedule.eval_samples=-4", "> 0"),
        ("schedule.eval_every=-1", "schedule.eval_every=-1", ">= 0"),
        ("schedule.micro_batches=0", "schedule.micro_batches=0", "> 0"),
        ("warmup.batch_size=0", "warmup.batch_size=0", "> 0"),
        ("warmup.lr=0", "warmup.lr=0.0", "> 0"),
        ("warmup.sft_steps=-1", "warmup.sft_steps=-1", ">= 0"),
        ("objective.kl_coef=-0.1", "objective.kl_coef=-0.1", ">= 0"),
        ("objective.distill_coef=-1", "objective.distill_coef=-1.0", ">= 0"),
        ("objective.clip_low=0", "objective.clip_low=0.0", "> 0"),
        ("objective.correction_low=3", "objective.correction_low=3.0", "<= objective.correction_high=2.0"),
        ("parallel.tp=0", "parallel.tp=0", "> 0"),
        ("parallel.expert_tp=0", "parallel.expert_tp=0", "> 0"),
        ("data.max_bad_rows=-1", "data.max_bad_rows=-1", ">= 0"),
        ("async_loop.max_staleness=-1", "async_loop.max_staleness=-1", ">= 0"),
        ("environment.max_turns=0", "environment.max_turns=0", "> 0"),
        ("rollout.n=1", "rollout.n=1 with advantage.estimator='grpo'", "rollout.n must be >= 2"),
        ("advantage.estimator=rloo", "rollout.n=1 with advantage.estimator='rloo'", "rollout.n must be >= 2"),
    ],
)
def test_out_of_range_value_names_the_key_and_the_range(override, key, allowed):
    extra = ["rollout.n=1"] if override.startswith("advantage.estimator") else []
    with pytest.raises(ConfigError) as e:
        load(override, *extra)
    msg = str(e.value)
    assert key in msg and allowed in msg, msg


def test_group_of_one_is_fine_for_an_estimator_that_is_not_group_relative():
    cfg = load("rollout.n=1", "advantage={estimator: reinforce_pp}")
    assert cfg.rollout.n == 1


@pytest.mark.parametrize(
    "override, get, want",
    [
        ("optimizer.lr=1e-4", lambda c: c.optimizer.lr, 1e-4),
        ("optimizer.adam_eps=1E-8", lambda c: c.optimizer.adam_eps, 1e-8),
        ("objective.clip_low=2e-1", lambda c: c.objective.clip_low, 0.2),  # float | None
        ("warmup.lr=+3e-3", lambda c: c.warmup.lr, 3e-3),
        ("optimizer.clip_grad=0", lambda c: c.optimizer.clip_grad, 0.0),  # 0 = no clipping, allowed
        ("rollout.temperature=0", lambda c: c.rollout.temperature, 0.0),  # greedy, allowed
    ],
)
def test_scientific_notation_and_documented_special_values_are_accepted(override, get, want):
    assert math.isclose(get(load(override)), want) if want else get(load(override)) == want


def test_scientific_notation_in_a_yaml_file_is_a_number(tmp_path):
    text = QUICKSTART.read_text().replace("lr: 3.0e-4", "lr: 3e-4")
    assert "lr: 3e-4" in text
    assert yaml.safe_load(text)["optimizer"]["lr"] == "3e-4"  # what PyYAML gives
    assert from_dict(yaml.safe_load(text)).optimizer.lr == 3e-4


@pytest.mark.parametrize("value", ["fast", "1e", "e-4", "nan", "inf", "1,0"])
def test_non_numbers_are_still_refused(value):
    with pytest.raises(ConfigError, match=f"optimizer.lr='{value}' must be a number"):
        load(f"optimizer.lr='{value}'")


def test_every_example_config_is_inside_the_ranges():
    for path in sorted(ROOT.glob("examples/*.yaml")):
        data = yaml.safe_load(path.read_text())
        if "base" in data or "model" not in data:
            continue  # a layered file or a fragment: covered through the files that use it
        from_dict(data)


def test_every_ranged_key_is_documented_with_its_range():
    text = (ROOT / "docs" / "configuration.md").read_text()
    for key in all_ranges():  # the contributed keys' too
        assert f"| `{key}` |" in text, key
        row = next(line for line in text.splitlines() if line.startswith(f"| `{key}` |"))
        assert f"| {range_text(key)} |" in row, row


def test_check_refuses_tp_that_does_not_divide_the_kv_heads(capsys):
    from megarl.trainer.train_cli import main

    args = [str(QUICKSTART), "parallel.tp=2", "model.hf_config.num_key_value_heads=1", "--check"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "parallel.tp=2 must divide num_attention_heads=4 and num_key_value_heads=1; allowed tp: 1" in err
    assert main([str(QUICKSTART), "parallel.tp=2", "--check"]) == 0  # 4 heads, 2 KV heads, vocab 24


def test_an_out_of_range_value_is_refused_before_torch_is_imported():
    code = (
        "import sys; from megarl.trainer.train_cli import main; "
        f"rc = main([{str(QUICKSTART)!r}, 'optimizer.lr=-1', '--check']); "
        "print(rc, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
    assert "optimizer.lr=-1.0 must be > 0" in out.stderr
