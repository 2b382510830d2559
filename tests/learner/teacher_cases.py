"""Full-vocabulary distillation on a sharded megatron learner (cases for tests/learner/dist_cases.py).

``fullvocab:<dense|moe>:<layout>``: a forward-only teacher learner under the layout fills
``teacher_logits`` (this rank's vocab shard, last stage) and ``teacher_topk``; a training step of the
student with ``distill: jsd`` (2 micro-batches, this replica's DP share of the batch) reports the
loss reference/loss.py:rl_loss gives on the gathered full-vocabulary student and teacher logits;
the top-K ids are torch.topk of the gathered teacher distribution.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather_tp(x: torch.Tensor, ln) -> torch.Tensor:
    tp = ln.groups.layout.tp
    if tp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x.contiguous(), group=ln.groups.tp)
    return torch.cat(parts, -1)


def case_fullvocab(args, moe: bool, layout_name: str) -> dict:
    """See the module docstring."""
    from megarl.batch import unpack
    from megarl.learner.forward import align_logits
    from megarl.objectives.rl_objective import ObjectiveConfig, RLObjective
    from megarl.plugin.teacher_pass import MegatronTeacherPass
    from reference.loss import rl_loss
    from tests.learner.dist_cases import (
        LAYOUTS,
        dp_shard,
        last_stage_logits,
        learner_for,
        make_batch,
        make_hf_model,
    )

    _, d = make_hf_model(moe, args.workdir)
    student = learner_for(LAYOUTS[layout_name], d)
    teacher = learner_for(LAYOUTS[layout_name], d)
    with torch.no_grad():  # another model: the same weights, sharper
        for p in teacher.model.parameters():
            p.mul_(1.5)
    batch = make_batch(41, lens=(7, 13, 5, 9, 6, 8))
    batch.old_logprobs, _ = student.compute_logprobs(batch)
    MegatronTeacherPass(teacher, frozenset({"teacher_logits", "teacher_topk"}), top_k=4).fill(batch, 2)
    cfg = ObjectiveConfig(policy_loss="none", aggregation="token-mean", distill="jsd", distill_coef=1.0)
    ref_loss, topk_ok = 0.0, True
    s_logits = last_stage_logits(student, batch)
    if s_logits is not None:
        full_s = align_logits(_gather_tp(s_logits, student), batch.cu_seqlens)
        full_t = _gather_tp(batch.token_extras["teacher_logits"], teacher)
        want = torch.log_softmax(full_t.double(), -1).topk(4, -1)
        m = batch.loss_mask.bool()
        topk_ok = bool(torch.equal(batch.token_extras["teacher_topk_ids"][m], want.indices[m]))
        topk_ok &= float((batch.token_extras["teacher_topk_logprobs"][m] - want.values[m]).abs().max()) < 1e-4
        pad = unpack(batch)
        am = pad.attention_mask
        lg = torch.zeros(*am.shape, full_s.shape[-1], dtype=torch.float64)
        lt = torch.zeros_like(lg)
        lg[am], lt[am] = full_s.double(), full_t.double()
        pt = pad.per_token
        ref_loss = float(
            rl_loss(
                lg,
                pad.tokens,
                pad.loss_mask.double(),
                pt["advantages"].double(),
                pt["old_logprobs"].double(),
                policy_loss="none",
                aggregation_mode="token-mean",
                distill="jsd",
                distill_coef=1.0,
                teacher_logits=lt,
            )
        )
    ref_loss = float(student._from_last_stage(torch.tensor([ref_loss], dtype=torch.float64)))
    ok_t = torch.tensor([float(topk_ok)], dtype=torch.float64)
    dist.all_reduce(ok_t, op=dist.ReduceOp.MIN)
    metrics = student.train_step(dp_shard(batch, student), RLObjective(cfg), num_micro_batches=2)
    diff = abs(metrics["loss"] - ref_loss)
    return {
        "megatron_loss": metrics["loss"],
        "reference_loss": ref_loss,
        "diff": diff,
        "topk_ok": bool(ok_t[0] > 0),
        "ok": diff <= 1e-5 and ref_loss > 1e-4 and bool(ok_t[0] > 0),
    }


CASES = {"fullvocab": case_fullvocab}
