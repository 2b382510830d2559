"""Dump pieces without a model: batch round trip through a dump's files, data-parallel shares
joined back into the global batch, model compatibility checks."""

import dataclasses

import pytest
import torch

from megarl.batch import from_sequences
from megarl.faults.dump import (
    DumpError,
    batch_from_dict,
    batch_to_dict,
    check_compatible,
    concat_batches,
    model_shape,
)
from megarl.objectives.api import GlobalNormalisers


def batch():
    b = from_sequences(
        [[2, 3], [2, 4, 5], [2, 6], [2, 7]],
        [[8, 9, 1], [10, 1], [11, 12, 13, 1], [14, 1]],
        [0, 0, 1, 1],
        rewards=torch.tensor([1.0, 0.0, 0.5, 0.2]),
        rollout_logprobs=torch.linspace(-1, 0, 20),
    )
    b.advantages = torch.randn(b.num_tokens)
    b.extras = {"w": torch.arange(4.0)}
    return b


def same(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
        elif isinstance(x, dict):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f.name
        else:
            assert x == y, f.name


def test_batch_dict_round_trip_and_dp_shares_concatenate_back():
    b = batch()
    same(batch_from_dict(batch_to_dict(b)), b)
    shares = [b.select([0, 1]), b.select([2, 3])]
    same(concat_batches(shares), b)
    assert concat_batches([b]) is b
    half = b.select([0])
    half.advantages = None
    with pytest.raises(DumpError, match="'advantages' is set in some data-parallel shares only"):
        concat_batches([half, b.select([1])])
    with pytest.raises(DumpError, match="not a PackedBatch field"):
        batch_from_dict({**batch_to_dict(b), "bogus": 1})
    assert GlobalNormalisers(**dataclasses.asdict(GlobalNormalisers(3.0, 2.0))) == GlobalNormalisers(3.0, 2.0)


def test_compatibility_allows_fewer_experts_only():
    base = {
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
    dumped = model_shape(base)
    assert check_compatible(dumped, base, "m") == []
    notes = check_compatible(dumped, {**base, "num_experts": 4}, "p")
    assert notes == ["proxy: 4 routed experts (top-2) instead of 8 (top-2)"]
    with pytest.raises(DumpError, match="recorded routes"):
        check_compatible(dumped, {**base, "num_experts": 4}, "p", uses_routes=True)
    with pytest.raises(
        DumpError, match=r"model d does not fit the dump: .*num_experts: dump 8, model 0 \(dense vs MoE\)"
    ):
        check_compatible(dumped, {**base, "model_type": "qwen3", "num_experts": 0}, "d")
    with pytest.raises(DumpError, match="num_attention_heads: dump 4, model 8; head_dim: dump 16, model 8"):
        check_compatible(dumped, {**base, "head_dim": 8, "num_attention_heads": 8}, "h")


class _TouchOnLoad:
    """A pickle payload: unpickling it with a plain pickle loader creates ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _state():
    """A dump state as the fault monitor writes it: objective state, learner step, RNG, detectors."""
    import random

    return {
        "objective_state": {
            "policy_loss": {
                "ema": torch.arange(3.0, dtype=torch.float64),
                "seen": torch.tensor([True, False, True]),
                "updates": 2,
            }
        },
        "learner_step": 7,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "detectors": {"loss": {"mean": 0.5, "var": 0.1, "count": 3}, "entropy_baseline": None},
    }


def _write(tmp_path):
    from megarl.faults.dump import write_dump

    b = batch()
    b.turn_spans = [[(0, 2, "user")], [(0, 3, "assistant")], [], [(1, 2, "tool")]]
    b.reward_names = ["a"]
    b.rewards = b.rewards[:, None]
    steps = [
        {
            "batch": b,
            "num_micro_batches": 2,
            "normalisers": GlobalNormalisers(11.0, 4.0, 3.0),
            "dp_shares": [b.select([0, 1]), b.select([2, 3])],
        }
    ]
    return write_dump(tmp_path / "step_000003", {"step": 3}, steps, _state(), None, {}), b


def test_dump_round_trips_through_weights_only_files(tmp_path):
    from megarl.faults.dump import read_dump

    d, b = _write(tmp_path)
    for name in ("batches.pt", "state.pt"):  # every file of a dump loads weights-only
        torch.load(d / name, weights_only=True)
    meta, steps, state = read_dump(d)
    assert meta["step"] == 3 and steps[0]["num_micro_batches"] == 2
    same(steps[0]["batch"], b)
    same(concat_batches(steps[0]["dp_shares"]), b)
    assert steps[0]["normalisers"] == GlobalNormalisers(11.0, 4.0, 3.0)
    want = _state()
    assert state["rng"]["python"] == want["rng"]["python"] and state["learner_step"] == 7
    assert torch.equal(state["rng"]["torch"], want["rng"]["torch"])
    assert torch.equal(state["objective_state"]["policy_loss"]["seen"], torch.tensor([True, False, True]))


@pytest.mark.parametrize("name", ["batches.pt", "state.pt"])
@pytest.mark.parametrize("legacy", [False, True])
def test_crafted_dump_file_is_refused_without_running_its_payload(tmp_path, name, legacy):
    import pickle

    from megarl.faults.dump import read_dump
    from megarl.proxy.replay import check_dump_and_model

    d, _ = _write(tmp_path)
    marker = tmp_path / "payload_ran"
    payload = {"x": _TouchOnLoad(marker)}
    if legacy:  # a bare pickle, not torch's zip format
        (d / name).write_bytes(pickle.dumps([payload]))
    else:
        torch.save([payload], d / name)
    for load in (read_dump, lambda p: check_dump_and_model(p, str(tmp_path / "model"))):
        with pytest.raises(
            DumpError,
            match=rf"{d / name}: refused: not a plain megarl dump file .*GLOBAL|"
            rf"{d / name}: refused: not a plain megarl dump file",
        ):
            load(d)
        assert not marker.exists()


def test_dump_state_is_made_plain_or_refused_by_key():
    import numpy as np

    from megarl.faults.dump import plain

    @dataclasses.dataclass
    class Stats:
        mean: float
        hist: object

    out = plain({"s": Stats(np.float64(0.5), np.arange(3)), "n": [np.int64(4), (1, "a")]})
    assert out["s"]["mean"] == 0.5 and type(out["s"]["mean"]) is float
    assert torch.equal(out["s"]["hist"], torch.arange(3)) and out["n"] == [4, (1, "a")]
    with pytest.raises(
        DumpError, match=r"state\['objective_state'\]\['f'\]: a builtins.builtin_function_or_method cannot"
    ):
        plain({"objective_state": {"f": len}})
