"""The self-teacher on a sharded megatron learner (cases for tests/learner/dist_cases.py).

``selfteacher:<dense|moe>:<layout>``, on every rank: with every context empty and ``forward: all``
the self-teacher's logprobs are the learner's own ``compute_logprobs`` bit for bit; with contexts of
different lengths (one sequence without) they equal transformers' log-softmax of the concatenated
sequence prompt + context + response at the response's tokens, and the context changes them; the
self-teacher's logits (``self_teacher_logits``) are transformers' logits of that sequence, this
rank's vocab shard, at the response's tokens.
"""

from __future__ import annotations

import math

import torch

from megarl.methods.distillation.self_teacher import CONTEXT, SelfTeacher, TeacherKnobs


def case_selfteacher(args, moe: bool, layout_name: str) -> dict:
    """See the module docstring."""
    from tests.learner.dist_cases import (
        LAYOUTS,
        PARITY_TOL,
        VOCAB,
        learner_for,
        make_batch,
        make_hf_model,
        max_over_world,
    )

    hf, d = make_hf_model(moe, args.workdir)
    ln = learner_for(LAYOUTS[layout_name], d)
    batch = make_batch(11)
    batch.extras[CONTEXT] = torch.full((batch.num_seqs, 4), math.nan, dtype=torch.float64)
    SelfTeacher(ln, TeacherKnobs(forward="all")).fill(batch, 2)
    own, _ = ln.compute_logprobs(batch, 2)
    empty_equal = bool(torch.equal(batch.self_teacher_logprobs, own.float()))

    g = torch.Generator().manual_seed(12)
    lens = [3, 0, 1, 4]
    rows = torch.full((batch.num_seqs, 4), math.nan, dtype=torch.float64)
    for i, k in enumerate(lens):
        rows[i, :k] = torch.randint(0, VOCAB, (k,), generator=g).double()
    batch.extras[CONTEXT] = rows
    SelfTeacher(ln, TeacherKnobs(), frozenset({"self_teacher_logprobs", "self_teacher_logits"})).fill(
        batch, 2
    )
    got, logits = batch.self_teacher_logprobs, batch.token_extras.get("teacher_logits")
    shard = VOCAB // ln.groups.layout.tp
    lo = ln.groups.tp_rank * shard
    cu, diff, diff_logits, moved = batch.cu_seqlens.tolist(), 0.0, 0.0, []
    for i in range(batch.num_seqs):
        p, seq = int(batch.prompt_lens[i]), batch.tokens[cu[i] : cu[i + 1]]
        if lens[i] == 0:
            continue
        full = torch.cat([seq[:p], rows[i, : lens[i]].long(), seq[p:]])
        with torch.no_grad():
            z = hf(full[None]).logits[0]
        lp = torch.log_softmax(z, -1)
        want = lp[p + lens[i] - 1 : -1].gather(-1, seq[p:, None])[:, 0]  # the response's tokens
        if logits is not None:  # the last stage's vocab shard, aligned: row t scored token t
            zt = z[p + lens[i] - 1 : -1, lo : lo + shard]
            diff_logits = max(diff_logits, float((logits[cu[i] + p : cu[i + 1]].cpu() - zt).abs().max()))
        diff = max(diff, float((got[cu[i] + p : cu[i + 1]] - want).abs().max()))
        moved.append(float((got[cu[i] + p : cu[i + 1]] - own[cu[i] + p : cu[i + 1]]).abs().max()))
    diff, diff_logits = max_over_world(diff), max_over_world(diff_logits)
    on = batch.extras["self_teacher_on"].tolist()
    return {
        "empty_context_equal": empty_equal,
        "vs_hf_concatenated": diff,
        "logits_vs_hf_concatenated": diff_logits,
        "context_moves_logprobs": min(moved),
        "forwarded": on,
        "ok": empty_equal
        and diff <= PARITY_TOL
        and diff_logits <= PARITY_TOL
        and min(moved) > 1e-3
        and on == [1.0, 0.0, 1.0, 1.0],
    }


CASES = {"selfteacher": case_selfteacher}
