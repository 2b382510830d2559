"""Detector unit tests: spikes against an EMA baseline, non-finite values, entropy and router
collapse, logprob gap; plus the config checks of the ``faults:`` section."""

import math

import pytest
import torch

from megarl.faults.config import DetectorConfig, FaultsConfig, InjectionConfig, validate_faults
from megarl.faults.detectors import DetectorSuite, SpikeDetector, router_load_stats


def types(events):
    return [e["type"] for e in events]


def test_spike_detector_flags_a_jump_after_warmup_only():
    w = SpikeDetector(z=6.0, beta=0.8, warmup=3, min_rel_std=0.05)
    assert [w.update(x) for x in (1.0, 1.0, 50.0)] == [None, None, None]  # warm-up: never a spike
    d = SpikeDetector(z=6.0, beta=0.8, warmup=3, min_rel_std=0.05)
    for x in (1.0, 1.1, 0.9, 1.05, 0.95, 1.0):
        assert d.update(x) is None
    hit = d.update(5.0)
    assert hit is not None and hit["z"] > 6.0 and hit["value"] == 5.0
    before = d.state_dict()
    assert d.update(5.0) is not None  # a spike does not move the baseline: still a spike
    assert d.state_dict() == before
    assert d.update(0.2) is None  # one-sided: a drop is not a grad-norm spike
    two = SpikeDetector(z=6.0, beta=0.8, warmup=3, min_rel_std=0.05, two_sided=True)
    for x in (1.0, 1.1, 0.9, 1.05, 0.95, 1.0):
        two.update(x)
    assert two.update(-4.0) is not None


def test_spike_std_floor_keeps_a_constant_series_from_flagging_noise():
    d = SpikeDetector(z=6.0, beta=0.8, warmup=3, min_rel_std=0.05)
    for _ in range(5):
        assert d.update(2.0) is None
    assert d.update(2.2) is None  # 10 % off a flat baseline: z = 0.2 / (0.05 * 2) = 2
    assert d.update(4.0) is not None  # z = 20


def test_nonfinite_loss_and_grad_norm_are_one_event_naming_both():
    s = DetectorSuite(DetectorConfig())
    ev = s.check(
        3, {"train/loss": float("nan"), "train/grad_norm": float("inf"), "train/update_successful": 0.0}
    )
    assert types(ev) == ["nonfinite"]
    assert ev[0]["step"] == 3 and ev[0]["detail"] == {
        "loss": "nan",
        "grad_norm": "inf",
        "optimizer_step_skipped": True,
    }
    assert s.check(4, {"train/loss": 0.1, "train/grad_norm": 1.0}) == []


def test_entropy_collapse_against_the_first_value_and_the_floor():
    s = DetectorSuite(DetectorConfig(entropy_drop_frac=0.1, entropy_min=0.0))
    assert s.check(1, {"train/entropy": 2.0}) == []
    assert s.check(2, {"train/entropy": 0.5}) == []
    ev = s.check(3, {"train/entropy": 0.15})
    assert types(ev) == ["entropy_collapse"] and ev[0]["detail"]["floor"] == pytest.approx(0.2)
    s2 = DetectorSuite(DetectorConfig(entropy_drop_frac=0.0, entropy_min=0.3))
    assert types(s2.check(1, {"train/entropy": 0.25})) == ["entropy_collapse"]


def test_logprob_gap_takes_the_worst_of_both_gaps():
    s = DetectorSuite(DetectorConfig(logprob_gap_max=0.5))
    assert s.check(1, {"train/train_rollout_logprob_gap": 0.4, "rollout/logprob_gap_old": 0.1}) == []
    ev = s.check(2, {"train/train_rollout_logprob_gap": 0.4, "rollout/logprob_gap_old": 0.9})
    assert types(ev) == ["logprob_gap"] and ev[0]["detail"]["metric"] == "rollout/logprob_gap_old"
    assert DetectorSuite(DetectorConfig(logprob_gap_max=0.0)).check(1, {"rollout/logprob_gap_old": 9.0}) == []
    # the first optimizer step's gap wins over the step mean (which holds the drift of later updates)
    rec = {"faults/logprob_gap_first": 1e-7, "train/train_rollout_logprob_gap": 0.9}
    assert s.check(3, rec) == []


def test_router_stats_and_collapse_per_layer():
    balanced = torch.full((8,), 10.0)
    collapsed = torch.tensor([0, 0, 40.0, 40.0, 0, 0, 0, 0])
    st = router_load_stats(torch.stack([balanced, collapsed]))
    assert st["imbalance"].tolist() == pytest.approx([1.0, 4.0])
    assert st["entropy"][0] == pytest.approx(1.0)
    assert st["entropy"][1] == pytest.approx(math.log(2) / math.log(8))
    s = DetectorSuite(DetectorConfig(router_entropy_min=0.5, router_imbalance_max=3.0))
    ev = s.check(5, {}, torch.stack([balanced, collapsed]), moe_layers=(1, 3))
    assert types(ev) == ["router_collapse", "load_imbalance"]
    assert all(e["detail"]["layer"] == 3 for e in ev)
    assert ev[0]["detail"]["experts_used"] == 2


def test_suite_state_round_trip_gives_the_same_verdicts():
    a = DetectorSuite(DetectorConfig())
    for i, g in enumerate((1.0, 1.2, 0.8, 1.1, 0.9), 1):
        a.check(i, {"train/grad_norm": g, "train/loss": 0.01 * i, "train/entropy": 2.0})
    b = DetectorSuite(DetectorConfig())
    b.load_state_dict(a.state_dict())
    rec = {"train/grad_norm": 9.0, "train/loss": 0.02, "train/entropy": 1.9}
    assert a.check(6, dict(rec)) == b.check(6, dict(rec))
    assert "grad_norm_spike" in types(b.check(7, dict(rec)))


@pytest.mark.parametrize(
    "bad, msg",
    [
        (FaultsConfig(inject=[InjectionConfig(kind="nan", target="")]), "target is required"),
        (FaultsConfig(inject=[InjectionConfig(kind="fp16", target="x", where="grad")]), "only for kinds"),
        (FaultsConfig(inject=[InjectionConfig(step=0, target="x")]), "step=0"),
        (FaultsConfig(dump_on=["nan"]), "faults.dump_on[0]='nan'"),
        (FaultsConfig(dump_steps=[0]), "dump_steps[0]"),
        (FaultsConfig(detectors=DetectorConfig(spike_beta=1.0)), "spike_beta"),
    ],
)
def test_bad_faults_config_names_the_key(bad, msg):
    with pytest.raises(ValueError) as e:
        validate_faults(bad)
    assert msg in str(e.value)


def test_trainer_config_loads_the_faults_section():
    from megarl.trainer.config import ConfigError, from_dict

    base = {"model": {"hf_config": {"model_type": "qwen3"}}, "data": {"train": "x.jsonl"}}
    cfg = from_dict(
        {
            **base,
            "faults": {
                "inject": [{"kind": "nan", "target": "decoder", "step": 3}],
                "detectors": {"spike_z": 4.0},
                "dump_on": ["nonfinite"],
            },
        }
    )
    assert cfg.faults.inject[0].step == 3 and cfg.faults.detectors.spike_z == 4.0
    with pytest.raises(ConfigError, match=r"unknown key faults.inject\[0\].stepp"):
        from_dict({**base, "faults": {"inject": [{"kind": "nan", "target": "decoder", "stepp": 3}]}})
    with pytest.raises(ConfigError, match="faults.inject\\[0\\].kind='nam'"):
        from_dict({**base, "faults": {"inject": [{"kind": "nam", "target": "decoder"}]}})


def test_absolute_std_floor_ignores_float_noise_of_a_zero_loss():
    cfg = DetectorConfig()  # spike_min_abs_std 1e-4
    s = DetectorSuite(cfg)
    for i, x in enumerate((-7e-9, -1.5e-8, 3e-9, -7e-9, 1e-8), 1):
        assert s.check(i, {"train/loss": x}) == []
    assert s.check(6, {"train/loss": -4.4e-7}) == []  # z = 40 against the noise, 0.004 against the floor
    assert types(s.check(7, {"train/loss": 0.05})) == ["loss_spike"]


def test_update_drift_spike_flags_an_over_large_update_within_a_step():
    """The figures of benchmarks/proxy_savings.py's original run (2 optimizer steps per trainer
    step): the step-mean train/rollout gap beyond the first update's is ~0.02, and 0.65 in the
    step whose learning rate was 1000x (the loss moved by 0.006 only: PPO's clipping bounds it)."""
    s = DetectorSuite(DetectorConfig())
    steps = [(0.0303, 2.2e-7), (0.0186, 1.6e-7), (0.0168, 1.6e-7), (0.180, 0.156), (0.0196, 1.8e-7)]
    for i, (mean, first) in enumerate(steps, 1):
        rec = {"train/train_rollout_logprob_gap": mean, "faults/logprob_gap_first": first}
        assert "update_drift_spike" not in types(s.check(i, rec)), i  # the poison at 4: its first gap
    ev = s.check(8, {"train/train_rollout_logprob_gap": 0.6498, "faults/logprob_gap_first": 2.4e-7})
    assert types(ev) == ["update_drift_spike"] and ev[0]["detail"]["z"] > 6
    # one optimizer step per trainer step: the step mean is the first update's gap, no drift at all
    one = DetectorSuite(DetectorConfig())
    for i, g in enumerate((0.01, 0.02, 0.01, 0.02, 0.5), 1):
        rec = {"train/train_rollout_logprob_gap": g, "faults/logprob_gap_first": g}
        assert "update_drift_spike" not in types(one.check(i, rec))
