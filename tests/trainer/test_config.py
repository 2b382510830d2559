"""Config loading: every bad key, type or layout fails at start with one message naming it."""

from pathlib import Path

import pytest
import yaml

from megarl.trainer.config import (
    ConfigError,
    apply_overrides,
    check_layout,
    from_dict,
    load_config,
    save_resolved,
)

ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def base() -> dict:
    return yaml.safe_load(QUICKSTART.read_text())


def test_quickstart_config_loads_and_embeds_core_grpo_unchanged():
    cfg = load_config(QUICKSTART)
    core = yaml.safe_load((ROOT / "examples" / "methods" / "core-grpo.yaml").read_text())
    raw = base()
    assert raw["advantage"] == core["advantage"] and raw["objective"] == core["objective"]
    assert cfg.advantage.estimator == "grpo" and cfg.advantage.knobs == {"scale_by_std": True}
    assert cfg.objective.kl_coef == 0.001 and cfg.objective.aggregation == "seq-mean-token-mean"


@pytest.mark.parametrize(
    "path", sorted((ROOT / "examples" / "methods").glob("core-*.yaml")), ids=lambda p: p.stem
)
def test_every_core_method_example_loads_as_written(path):
    cfg = load_config(path)  # laid over examples/quickstart.yaml through its base: key
    core = yaml.safe_load(path.read_text())
    assert core["base"] == "../quickstart.yaml"
    assert cfg.advantage.estimator == core["advantage"]["estimator"]
    assert cfg.objective.policy_loss == core["objective"]["policy_loss"]
    assert cfg.schedule.steps == base()["schedule"]["steps"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["schedule"].update(stepz=3), "unknown key schedule.stepz; allowed in schedule: steps"),
        (lambda d: d.update(trainer={}), "unknown key trainer; allowed in the top level: model"),
        (lambda d: d["schedule"].update(steps="ten"), "schedule.steps='ten' must be an integer"),
        (lambda d: d["schedule"].update(steps=2.5), "schedule.steps=2.5 must be an integer"),
        (lambda d: d["optimizer"].update(lr="fast"), "optimizer.lr='fast' must be a number"),
        (
            lambda d: d["rollout"].update(engine="vllm2"),
            "rollout.engine='vllm2'; allowed: 'embedded', 'vllm', 'sglang'",
        ),
        (
            lambda d: d["objective"].update(policy_loss="ppo2"),
            "objective.policy_loss='ppo2'; allowed: .*cispo",
        ),
        (
            lambda d: d["objective"].update(clip_hi=0.3),
            "unknown key objective.clip_hi; allowed in objective: policy_loss",
        ),
        (
            lambda d: d["advantage"].update(estimator="grpo2"),
            "advantage.estimator='grpo2'; allowed: .*dr_grpo, .*gae",
        ),
        (
            lambda d: d["advantage"].update(gamma=0.9),
            "unknown key advantage.gamma for estimator 'grpo'; allowed: estimator, scale_by_std, eps",
        ),
        (
            lambda d: d["advantage"].update(scale_by_std="yes"),
            "advantage.scale_by_std='yes' must be true or false",
        ),
        (lambda d: d["rollout"].update(n=0), "rollout.n=0 must be > 0"),
        (
            lambda d: d["reward"]["functions"][0].update(kind="python"),
            "reward.functions\\[0\\].function must be 'module:function'",
        ),
        (
            lambda d: d["reward"]["functions"][0].update(kindd="x"),
            "unknown key reward.functions\\[0\\].kindd",
        ),
        (lambda d: d["rollout"].update(engine="vllm"), "rollout.engine='vllm' needs rollout.urls"),
        (
            lambda d: d["data"].update(on_bad_row="ignore"),
            "data.on_bad_row='ignore'; allowed: 'fatal', 'skip'",
        ),
        (
            lambda d: d["schedule"].update(mini_batches=99),
            "schedule.mini_batches=99 must be <= schedule.prompts_per_step",
        ),
    ],
)
def test_bad_config_is_named(mutate, message):
    d = base()
    mutate(d)
    with pytest.raises(ConfigError, match=message):
        from_dict(d)


def test_overrides_parse_yaml_values_and_create_sections():
    d = apply_overrides(
        base(), ["schedule.steps=3", "optimizer.lr=1.0e-4", "logging.run_dir=/tmp/x", "sampling.dynamic=true"]
    )
    cfg = from_dict(d)
    assert cfg.schedule.steps == 3 and cfg.optimizer.lr == 1e-4 and cfg.logging.run_dir == "/tmp/x"
    assert cfg.sampling.dynamic is True
    with pytest.raises(ConfigError, match="override 'schedule.steps' must look like section.key=value"):
        apply_overrides({}, ["schedule.steps"])
    with pytest.raises(ConfigError, match="unknown key schedule.stpes"):
        load_config(QUICKSTART, ["schedule.stpes=3"])


@pytest.mark.parametrize(
    "parallel, world, message",
    [
        (
            {"tp": 3},
            3,
            "parallel.tp=3 must divide num_attention_heads=4 and num_key_value_heads=2; allowed tp: 1, 2",
        ),
        ({"tp": 2}, 3, "parallel: tp\\*pp\\*cp=2 must divide the world size 3"),
        ({"ep": 2}, 2, "parallel.ep=2 must divide num_experts=0 \\(a dense model needs ep=1\\)"),
        ({"pp": 3}, 3, "parallel.pp=3 must divide num_hidden_layers=2; allowed pp: 1, 2"),
        ({"world_size": 4}, 2, "parallel.world_size=4 but this job has 2 process"),
        ({"tp": 1, "sequence_parallel": True}, 1, "sequence_parallel=true needs parallel.tp > 1"),
    ],
)
def test_impossible_layouts_fail_at_start(parallel, world, message):
    d = base()
    d["parallel"] = parallel
    cfg = from_dict(d)
    hf = dict(cfg.model.hf_config, vocab_size=24)
    with pytest.raises(ConfigError, match=message):
        check_layout(cfg, hf, world)


def test_moe_expert_parallel_must_divide_experts():
    cfg = from_dict(dict(base(), parallel={"ep": 3}))
    hf = dict(cfg.model.hf_config, vocab_size=24, num_experts=8)
    with pytest.raises(ConfigError, match="parallel.ep=3 must divide num_experts=8; allowed ep: 1, 2, 4, 8"):
        check_layout(cfg, hf, 3)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(QUICKSTART, ["schedule.steps=7"])
    out = save_resolved(cfg, tmp_path)
    again = from_dict(yaml.safe_load(out.read_text()))
    assert again == cfg


def test_cli_reports_config_error(capsys):
    from megarl.trainer.train_cli import main

    assert main([str(QUICKSTART), "rollout.temprature=0.5"]) == 2
    err = capsys.readouterr().err
    assert "config error: unknown key rollout.temprature; allowed in rollout:" in err
    assert main([str(QUICKSTART), "--check"]) == 0
