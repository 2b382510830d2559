"""REGEN's replay files: a batch written after the advantage step and read back by another reader
trains the same (loss and gradient), a file made with another tokenizer or template is refused
naming the file and the field, and the reader's cursor survives a checkpoint."""

from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch

from megarl.batch import from_sequences
from megarl.data.tokenizer import CharTokenizer
from megarl.methods.agents.regen import SPEC, RegenKnobs
from megarl.methods.agents.replay import (
    ReplayReader,
    ReplaySource,
    ReplayWriter,
    episode_rows,
    episodes_batch,
    stored,
    tokenizer_fingerprint,
    write_episodes,
)
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.plugin.knobs import build_knobs
from megarl.plugin.spec import BatchSource
from megarl.testing.equivalence import Case, megarl_loss_and_grad
from megarl.trainer.method_runtime import AdvantageStage, MethodRuntime

TOK = CharTokenizer("0123456789+=RC ")
FP = tokenizer_fingerprint(TOK)


def _batch(seed: int = 0, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    resp = [int(x) for x in torch.randint(1, 5, (n,), generator=g)]
    b = from_sequences(
        [[1, 2 + i % 3] for i in range(n)],
        [torch.randint(0, 16, (k,), generator=g).tolist() for k in resp],
        [i // 2 for i in range(n)],
    )
    b.loss_mask[b.prompt_lens[0] + 1] = 0.0  # a hole in the first response
    a = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, -2.0])[:n]
    b.advantages = a[b.seq_index()] * b.loss_mask
    b.rollout_logprobs = -torch.rand(b.num_tokens, generator=g)
    return b


def test_replayed_episodes_train_like_the_original_batch(tmp_path):
    b = _batch()
    w = ReplayWriter(tmp_path, FP, "none", rank0=True)
    assert w.before_train(3, b) is b and w.after_step(3, {}) == {"regen/replay_written": 6.0}
    rows = ReplayReader(tmp_path, FP, "none").next_rows(100)
    assert [r["origin"] for r in rows] == [
        "positive",
        "negative",
        "positive",
        "negative",
        "positive",
        "negative",
    ]
    r = episodes_batch(rows)
    assert torch.equal(r.tokens, b.tokens) and torch.equal(r.loss_mask, b.loss_mask)
    m = b.loss_mask.bool()
    assert torch.equal(r.rollout_logprobs[m], b.rollout_logprobs[m])
    torch.testing.assert_close(stored(r), b.advantages.double())  # the stored advantages as they are
    logits = torch.randn(b.num_tokens, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    cfg = ObjectiveConfig(
        policy_loss="regen", aggregation="seq-mean-token-sum", policy_loss_args={"alpha": 2.0}
    )
    want = megarl_loss_and_grad(Case(batch=b, logits=logits, cfg=cfg), tp=2, micro_batches=2)
    got = megarl_loss_and_grad(Case(batch=r, logits=logits, cfg=cfg), tp=2, micro_batches=2)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)


def test_a_file_of_another_tokenizer_or_template_is_refused_by_name(tmp_path):
    write_episodes(tmp_path / "step_000001.parquet", episode_rows(_batch(), 1), FP, "none")
    other = tokenizer_fingerprint(CharTokenizer("0123456789+=RC x"))
    with pytest.raises(ValueError, match=r"step_000001\.parquet.*'megarl\.tokenizer'"):
        ReplayReader(tmp_path, other, "none").next_rows(1)
    with pytest.raises(ValueError, match=r"step_000001\.parquet.*'megarl\.chat_template'"):
        ReplayReader(tmp_path, FP, "{{ messages }}").next_rows(1)


def test_a_bad_origin_label_is_refused_naming_row_and_field(tmp_path):
    rows = episode_rows(_batch(), 1)
    rows[2]["origin"] = "neutral"
    write_episodes(tmp_path / "a.parquet", rows, FP, "none")
    with pytest.raises(ValueError, match=r"a\.parquet: row 2 field 'origin'"):
        ReplayReader(tmp_path, FP, "none").next_rows(1)


def test_cursor_resumes_where_the_checkpoint_left_off(tmp_path):
    for step in (1, 2):
        write_episodes(tmp_path / f"step_{step:06d}.parquet", episode_rows(_batch(step, 4), step), FP, "none")
    assert pq.read_metadata(tmp_path / "step_000001.parquet").num_rows == 4
    straight = ReplayReader(tmp_path, FP, "none")
    first = straight.next_rows(3) + straight.next_rows(3)
    a = ReplayReader(tmp_path, FP, "none")
    a.next_rows(3)
    b = ReplayReader(tmp_path, FP, "none")
    b.load_state_dict(a.state_dict())
    assert b.next_rows(3) == first[3:]
    assert [r["step"] for r in first] == [1, 1, 1, 1, 2, 2]
    assert len(b.next_rows(10)) == 2 and b.next_rows(1) == []


def test_source_gives_fixed_size_batches_wraps_around_and_resumes(tmp_path):
    for step in (1, 2):
        write_episodes(tmp_path / f"step_{step:06d}.parquet", episode_rows(_batch(step, 4), step), FP, "none")
    src = ReplaySource(ReplayReader(tmp_path, FP, "none"), size=3)
    batches = [src.next_batch(s) for s in range(1, 4)]  # 9 episodes of 8: the third batch wraps
    assert [x.num_seqs for x in batches] == [3, 3, 3] and src.epoch == 1
    # groups: one per stored (step, group_id); the batch spanning both files keeps them apart
    assert batches[1].group_ids.tolist() == [0, 1, 1]
    again = ReplaySource(ReplayReader(tmp_path, FP, "none"), size=3)
    again.next_batch(1)
    resumed = ReplaySource(ReplayReader(tmp_path, FP, "none"), size=3)
    resumed.load_state_dict(again.state_dict())
    for want in batches[1:]:
        assert torch.equal(resumed.next_batch(0).tokens, want.tokens)
    with pytest.raises(ValueError, match="no replay files"):
        ReplaySource(ReplayReader(tmp_path / "empty", FP, "none"), size=3)


def test_stored_estimator_needs_replayed_episodes():
    with pytest.raises(ValueError, match="advantage.estimator=stored needs replayed episodes"):
        stored(_batch())


class _Cfg:
    class advantage:
        estimator, knobs = "stored", {}


def test_the_method_runtime_checkpoints_the_batch_source(tmp_path):
    write_episodes(tmp_path / "step_000001.parquet", episode_rows(_batch(1, 4), 1), FP, "none")
    src = ReplaySource(ReplayReader(tmp_path, FP, "none"), size=3)
    src.next_batch(1)
    state = MethodRuntime(inputs={}, advantages=AdvantageStage(_Cfg), batch_source=src).state_dict()
    assert state["batch_source"] == {"file_index": 0, "row": 3, "epoch": 0}
    fresh = MethodRuntime(
        inputs={},
        advantages=AdvantageStage(_Cfg),
        batch_source=ReplaySource(ReplayReader(tmp_path, FP, "none"), 3),
    )
    fresh.load_state_dict(state, rank0=False)  # every rank restores it
    assert fresh.batch_source.state_dict() == state["batch_source"]
    del state["batch_source"]
    with pytest.raises(ValueError, match="no batch source state"):
        fresh.load_state_dict(state)


def test_the_method_builds_its_writer_and_source_from_its_knobs(tmp_path):
    write_episodes(tmp_path / "in" / "step_000001.parquet", episode_rows(_batch(1, 4), 1), FP, "none")
    cfg = SimpleNamespace(
        logging=SimpleNamespace(run_dir=str(tmp_path)),
        data=SimpleNamespace(chat_template=False),
        schedule=SimpleNamespace(prompts_per_step=2),
        rollout=SimpleNamespace(n=3),
    )
    ctx = SimpleNamespace(cfg=cfg, tokenizer=TOK, rank0=True)
    knobs = build_knobs(RegenKnobs, {"replay_out": "out", "replay_in": "in"}, "method")
    parts = SPEC.build(ctx, knobs)
    assert isinstance(parts.step_hooks[0], ReplayWriter) and parts.step_hooks[0].folder == tmp_path / "out"
    assert isinstance(parts.batch_source, BatchSource) and parts.batch_source.size == 6
    assert SPEC.build(ctx, build_knobs(RegenKnobs, {}, "method")).batch_source is None
    with pytest.raises(ValueError, match="method.replay_batch"):
        build_knobs(RegenKnobs, {"replay_batch": -1}, "method")
