"""The asynchronous loop (megarl/trainer/async_loop.py).

- config: the async_loop section is validated like every other;
- the producer with the real embedded engine on a tiny random model: a weight update while a
  request is in flight aborts it; ``abort`` regenerates it with the new weights, ``continue`` keeps
  its prefix and finishes it with the new weights; every sample's recorded version (and, for a
  continued sample, the switch point) agrees with the model that actually produced its logprobs;
- end to end on the shrunk quickstart (slow): the staleness bound holds on the recorded versions
  of every sample, the loop really runs ahead (staleness 1 occurs), a resumed run trains on the
  queued batch saved in the checkpoint, and with max_staleness=0 the async loop reproduces the
  synchronous loop's metrics exactly.

The method examples (reward shapers, multi-turn workflows, allocators) run through the
asynchronous loop in the shared smoke run: tests/trainer/test_method_examples.py, dense and MoE EP=2.
"""

import asyncio
import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.data.dataset import PromptDataset, PromptRow, PromptSampler
from megarl.data.tokenizer import CharTokenizer
from megarl.rewards.compute import RewardComputer
from megarl.rollout.embedded import EmbeddedEngine, hf_model_from_config, teacher_forced_logprobs
from megarl.trainer.async_loop import AsyncRollouts, AsyncTrainer, ThreadEventLoop, staleness_of, too_stale
from megarl.trainer.config import ConfigError, from_dict
from megarl.trainer.loop import Trainer, trainer_class
from megarl.trainer.method_runtime import MethodRuntime
from megarl.trainer.run import Run
from tests.rollout.decoding import DecodeHold

ROOT = Path(__file__).parents[2]
HF = {
    "model_type": "qwen3",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 96,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
BASE = {"model": {"hf_config": HF, "alphabet": "0123456789R= "}, "data": {"train": "unused.jsonl"}}


# ----------------------------------------------------------------------------------------- config
def test_async_section_is_validated():
    cfg = from_dict(
        dict(BASE, async_loop={"enabled": True, "max_staleness": 2, "partial_rollout": "continue"})
    )
    assert cfg.async_loop.max_staleness == 2 and trainer_class(cfg) is AsyncTrainer
    assert trainer_class(from_dict(BASE)) is Trainer
    with pytest.raises(
        ConfigError, match=r"async_loop.partial_rollout='resume'; allowed: 'abort', 'continue'"
    ):
        from_dict(dict(BASE, async_loop={"partial_rollout": "resume"}))
    with pytest.raises(ConfigError, match=r"async_loop.max_staleness=-1 must be >= 0"):
        from_dict(dict(BASE, async_loop={"max_staleness": -1}))
    with pytest.raises(ConfigError, match=r"unknown key async_loop.staleness"):
        from_dict(dict(BASE, async_loop={"staleness": 1}))


def test_staleness_helpers():
    assert staleness_of([3, 2, 2, 0], train_version=3) == [0, 1, 1, 3]
    assert too_stale([3, 2, 0, 1], train_version=3, max_staleness=1) == [2, 3]
    assert too_stale([3, 2], train_version=3, max_staleness=0) == [1]


# ----------------------------------------------------------------------------------------- producer
class _Run(Run):
    """Samples run to max_new_tokens (no EOS stop) so that a request is long enough to be caught
    in flight by a weight update."""

    def sampling_params(self, step, rnd, i, greedy=False):
        return dataclasses.replace(
            super().sampling_params(step, rnd, i, greedy), ignore_eos=True, stop_token_ids=()
        )


class _Trainer:
    """The asynchronous rollout source over an embedded engine, as ``AsyncTrainer`` assembles it."""

    def __init__(self, source: AsyncRollouts):
        self.source, self.engine, self.loop, self.producer = (
            source,
            source.run.engine,
            source.run.loop,
            source.producer,
        )

    def _start_producer(self, step: int) -> None:
        self.source.start()

    def _rollout(self, step: int):
        return self.source.take(step)


def make_trainer(partial: str, tmp: Path) -> _Trainer:
    cfg = from_dict(
        dict(
            BASE,
            reward={"functions": [{"name": "low", "kind": "regex", "pattern": "^[0-4]"}]},
            rollout={"n": 3, "max_new_tokens": 80},
            schedule={"prompts_per_step": 3, "steps": 2},
            async_loop={"enabled": True, "max_staleness": 1, "partial_rollout": partial},
            logging={"run_dir": str(tmp)},
        )
    )
    run = _Run(cfg)
    run.rank0, run.tok, run.hf = True, CharTokenizer(cfg.model.alphabet), dict(HF)
    torch.manual_seed(0)
    model = hf_model_from_config(
        dict(HF, vocab_size=run.tok.vocab_size, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    )
    run.engine = EmbeddedEngine(model, eos_token_ids=[1], weight_version="0")
    run.loop = ThreadEventLoop()
    rows = [
        PromptRow(prompt=f"R {i:03d}=", answer=f"{i:03d}"[::-1], task="reverse", source=f"mem:{i}")
        for i in range(50)
    ]
    run.train_ds, run.eval_ds = PromptDataset(rows), None
    run.sampler = PromptSampler(len(rows), 0)
    run.rewards = RewardComputer(cfg.reward)
    run.failures_total = {"errors": 0, "timeouts": 0}
    run.spec = run.method_knobs = None
    run.method = MethodRuntime.build_learner_side(run.context())
    source = AsyncRollouts(run, 0)
    run.build_rank0_parts(wrap_engine=source.producer.gate)
    return _Trainer(source)


def hold_step_two(t: _Trainer, tokens: int = 3) -> DecodeHold:
    """Hold the engine's batch thread in a decode step of step 2's batch once its requests have
    sampled ``tokens`` tokens: a weight update made meanwhile finds them in flight a few tokens in.
    Made before the producer starts."""
    engine, producer = t.engine, t.producer

    def when() -> bool:
        steps = [job.steps for job in list(engine._batcher.active)]
        return producer.next_step == 2 and min(steps, default=0) >= tokens

    return DecodeHold(engine, when)


def update_while_in_flight(t: _Trainer, hold: DecodeHold) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Once step 2's requests are held in flight, swap in new random weights as version 1 the way
    the trainer's weight sync does it; returns (model v0, model v1)."""
    engine = t.engine
    assert hold.held.wait(60), "no request of step 2 in flight"
    t.loop.run_until_complete(t.producer.before_update())  # aborts them (flags only: no engine lock)
    hold.release()  # they leave the batch with the tokens they have
    old = copy.deepcopy(engine.model)
    new_state = {k: v + 0.5 * torch.randn_like(v) for k, v in old.state_dict().items()}
    t.loop.run_until_complete(engine.update_weights_from_tensors(new_state, "1"))
    t.loop.run_until_complete(t.producer.after_update(1))
    return old, engine.model


def per_token_source(ro, i, m0, m1) -> list[int]:
    """For sample i: which model (0 or 1) produced each token's recorded logprob."""
    got = torch.tensor(ro.rollout_logprobs[i])
    l0 = teacher_forced_logprobs(m0, ro.prompt_ids[i], ro.response_ids[i])
    l1 = teacher_forced_logprobs(m1, ro.prompt_ids[i], ro.response_ids[i])
    src = []
    for g, a, b in zip(got.tolist(), l0.tolist(), l1.tolist()):
        ok0, ok1 = abs(g - a) < 1e-4, abs(g - b) < 1e-4
        assert ok0 or ok1, f"sample {i}: logprob {g} matches neither model ({a}, {b})"
        src.append(0 if ok0 else 1)
    return src


@pytest.mark.parametrize("partial", ["abort", "continue"])
def test_weight_update_mid_rollout(partial, tmp_path):
    t = make_trainer(partial, tmp_path)
    hold = hold_step_two(t)
    try:
        t._start_producer(step=1)
        ro1, _ = t._rollout(1)  # version 0 throughout
        assert set(ro1.versions) == {0}
        m0, m1 = update_while_in_flight(t, hold)  # step 2's batch is being generated (max_staleness=1)
        ro2, st = t._rollout(2)
        c = st["async"]
        assert c["async/aborted_requests_total"] >= 1
        assert set(ro2.versions) <= {0, 1} and max(staleness_of(ro2.versions, 1)) <= 1
        assert all(len(r) == 80 for r in ro2.response_ids)  # every sample ran to its full length
        for i, v in enumerate(ro2.versions):
            src = per_token_source(ro2, i, m0, m1)
            if partial == "abort" or set(src) == {v}:
                assert set(src) == {v}, (i, v, src)  # the whole sample from the model of its version
            else:  # continued across the update: an old prefix, then the new weights
                assert v == 0 and src == sorted(src) and set(src) == {0, 1}, (i, src)
        mixed = sum(1 for i in range(len(ro2.versions)) if len(set(per_token_source(ro2, i, m0, m1))) == 2)
        if partial == "continue":
            assert (
                c["async/continued_samples_total"] >= 1
                and mixed >= 1
                and c["async/mixed_version_samples"] == mixed
            )
        else:
            assert c["async/resubmitted_groups_total"] >= 1 and mixed == 0
            assert 1 in ro2.versions
    finally:
        hold.release()
        t.loop.run_until_complete(t.producer.stop())
        t.loop.close()


# ----------------------------------------------------------------------------------------- end to end
def overrides(tmp: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        f"logging.run_dir={run_dir}",
        f"data.train={tmp / 'train.jsonl'}",
        f"data.eval={tmp / 'eval.jsonl'}",
        "data.generate.num_train=300",
        "data.generate.num_eval=16",
        "warmup.sft_steps=4",
        "warmup.batch_size=16",
        f"schedule.steps={steps}",
        "schedule.prompts_per_step=4",
        "schedule.mini_batches=2",
        "rollout.n=4",
        "schedule.eval_samples=8",
        "schedule.eval_k=2",
        "checkpoint.every=2",
        "checkpoint.keep_last=3",
        "logging.plot=false",
    ]


def run(args: list[str], config: Path = ROOT / "examples" / "quickstart.yaml") -> str:
    env = {"MEGARL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    p = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "train", str(config), *args],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def metrics(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_async_quickstart_respects_the_staleness_bound_and_resumes_its_queue(tmp_path):
    run_dir = tmp_path / "async"
    args = overrides(tmp_path, run_dir, steps=4) + [
        "async_loop.enabled=true",
        "async_loop.max_staleness=1",
        "async_loop.partial_rollout=continue",
    ]
    run(args)
    m = metrics(run_dir)
    assert sorted(m) == [0, 1, 2, 3, 4]
    seen_stale = 0
    for s in (1, 2, 3, 4):
        r = m[s]
        versions = {int(v): c for v, c in r["async/versions"].items()}
        assert sum(versions.values()) == r["rollout/samples"] == 16
        assert r["async/train_version"] == s - 1
        assert all(0 <= s - 1 - v <= 1 for v in versions), (s, versions)  # the bound, sample by sample
        assert r["async/staleness_max"] == max(s - 1 - v for v in versions)
        seen_stale += sum(c for v, c in versions.items() if v < s - 1)
        assert r["train/update_successful"] == 1.0 and 0.0 <= r["reward/mean"] <= 1.0
        assert r["rollout/logprob_gap_old"] >= 0.0
    assert seen_stale > 0, "the producer never ran ahead of the learner"
    saved = json.loads((run_dir / "checkpoints" / "step_000002" / "trainer.json").read_text())["async"]
    queued_steps = [b["step"] for b in saved["queued"]]
    assert queued_steps in ([], [3]) and saved["next_step"] == 3 + len(queued_steps)

    # resume from step 2: the queued batch (if any) saved with the checkpoint is what step 3 trains on
    import shutil

    shutil.rmtree(run_dir / "checkpoints" / "step_000004")
    out = run(args)
    assert "resumed from" in out and "step_000002 (step 2)" in out
    m2 = metrics(run_dir)
    assert sorted(m2) == [0, 1, 2, 3, 4]
    if queued_steps:
        assert f"async state restored: queued batches: {len(queued_steps)}," in out
        assert m2[3]["async/versions"] == m[3]["async/versions"]
        assert m2[3]["rollout/example"] == m[3]["rollout/example"]
        assert m2[3]["reward/mean"] == m[3]["reward/mean"]
    for s in (3, 4):
        assert all(0 <= s - 1 - int(v) <= 1 for v in m2[s]["async/versions"])


DETERMINISTIC = (
    "reward/mean",
    "reward/std",
    "train/loss",
    "train/kl",
    "train/entropy",
    "train/grad_norm",
    "adv/std",
    "rollout/response_len",
    "rollout/example",
)


@pytest.mark.slow
def test_async_with_zero_staleness_reproduces_the_synchronous_loop(tmp_path):
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async0"
    run(overrides(tmp_path, sync_dir, steps=2))
    run(overrides(tmp_path, async_dir, steps=2) + ["async_loop.enabled=true", "async_loop.max_staleness=0"])
    a, b = metrics(sync_dir), metrics(async_dir)
    for s in (1, 2):
        assert b[s]["async/staleness_max"] == 0 and b[s]["async/versions"] == {str(s - 1): 16}
        for k in DETERMINISTIC:
            assert b[s][k] == a[s][k], (s, k, a[s][k], b[s][k])


def test_thread_event_loop_runs_coroutines_from_another_thread():
    loop = ThreadEventLoop()
    try:

        async def where():
            await asyncio.sleep(0)
            import threading

            return threading.current_thread().name

        assert loop.run_until_complete(where()) == "megarl-rollout"
    finally:
        loop.close()
