"""Teacher signals beyond sampled-token logprobs: the student's logprobs at arbitrary ids (a
masked vocab-parallel gather) and the JSD op equal reference/ in value and gradient at TP 1, 2, 3;
the teacher's top-K from sharded logits equals torch.topk of the full ones; the Megatron teacher's
logits reach the loss per micro-batch, so a full-vocabulary distillation step on the learner equals
reference/'s loss (micro-batches 1 and 2)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.ops.vocab_parallel import vocab_parallel_gather_logprobs, vocab_parallel_jsd
from megarl.plugin.teacher_pass import topk_logprobs
from megarl.testing.simulated_group import SimulatedWorld
from reference import distillation as rd


@settings(max_examples=5, deadline=None)
@given(tp=st.sampled_from([1, 2, 3]), T=st.integers(1, 7), K=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_gather_and_jsd_equal_reference_in_value_and_gradient(tp, T, K, seed):
    g = torch.Generator().manual_seed(seed)
    V = 6 * tp
    a, b = (torch.randn(T, V, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    ids = torch.randint(0, V, (T, K), generator=g)
    w, w2 = (
        torch.randn(T, K, generator=g, dtype=torch.float64),
        torch.randn(T, generator=g, dtype=torch.float64),
    )
    A, B = a.clone().requires_grad_(), b.clone().requires_grad_()
    ref_g, ref_j = rd.logprobs_at(A, ids), rd.jsd(A, B)
    ((ref_g * w).sum() + (ref_j * w2).sum()).backward()

    def rank(r, group):
        x, y = a.chunk(tp, -1)[r].clone().requires_grad_(), b.chunk(tp, -1)[r].clone().requires_grad_()
        got_g, got_j = vocab_parallel_gather_logprobs(x, ids, group, 2), vocab_parallel_jsd(x, y, group, 2)
        ((got_g * w).sum() + (got_j * w2).sum()).backward()
        return got_g.detach(), got_j.detach(), x.grad, y.grad

    outs = SimulatedWorld(tp).run(rank)
    for got_g, got_j, _, _ in outs:
        torch.testing.assert_close(got_g, ref_g.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(got_j, ref_j.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([o[2] for o in outs], -1), A.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([o[3] for o in outs], -1), B.grad, rtol=0, atol=1e-12)


def test_teacher_topk_from_shards_equals_full_topk():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 12, generator=g, dtype=torch.float64)
    want = torch.log_softmax(logits, -1).topk(4, -1)
    for tp in (1, 2, 3):
        outs = SimulatedWorld(tp).run(lambda r, grp, tp=tp: topk_logprobs(logits.chunk(tp, -1)[r], 4, grp))
        for ids, lp in outs:
            assert torch.equal(ids, want.indices)
            torch.testing.assert_close(lp.double(), want.values, rtol=0, atol=1e-6)


def test_full_vocab_distillation_step_equals_reference(tmp_path):
    """A teacher learner fills token_extras['teacher_logits']; a train step with distill: jsd
    (micro-batches 1 and 2) reports the reference loss of the student's and teacher's logits."""
    import dataclasses

    from megarl.learner.factory import build_learner
    from megarl.learner.optim_config import OptimConfig
    from megarl.objectives.objective_config import ObjectiveConfig
    from megarl.objectives.rl_objective import build_objective
    from megarl.plugin.teacher_pass import MegatronTeacherPass
    from megarl.testing.equivalence import Case, reference_loss_and_grad
    from tests.methods.teacher_cases import student_batch, tiny_learner_setup

    hf, groups = tiny_learner_setup(48)
    teacher = build_learner(hf, groups, OptimConfig(), seed=7, trainable=False)
    batch = student_batch(48, [5, 6, 7], lens=(4, 9, 6, 3))
    batch.advantages = torch.zeros(batch.num_tokens)
    batch.old_logprobs = torch.zeros(batch.num_tokens)
    MegatronTeacherPass(teacher, frozenset({"teacher_logits", "teacher_topk"}), top_k=3).fill(batch, 2)
    t_logits = batch.token_extras["teacher_logits"]
    assert t_logits.shape == (batch.num_tokens, 48) and batch.token_extras["teacher_topk_ids"].shape[1] == 3
    cfg = ObjectiveConfig(policy_loss="none", aggregation="token-mean", distill="jsd", distill_coef=1.0)
    student = build_learner(hf, groups, OptimConfig(lr=0.0), seed=3)  # lr 0: the same weights each step
    s_logits = student.compute_logits(batch, 1)
    want, _ = reference_loss_and_grad(
        Case(dataclasses.replace(batch), s_logits.double(), cfg, t_logits.double())
    )
    for micro in (1, 2):
        m = student.train_step(batch, build_objective(cfg), micro)
        assert abs(m["loss"] - float(want)) < 1e-5, (micro, m["loss"], float(want))
        assert float(want) > 1e-3  # different teacher and student: a real divergence
