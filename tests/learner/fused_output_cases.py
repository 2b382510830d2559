"""The fused output layer inside the megatron learner (a case for tests/learner/dist_cases.py).

``fused:<model>:<layout>``: one learner, the same weights, ``fused_output`` off then on: the logprob
pass (logprobs and entropies), the top-K pass (ids and logprobs of a teacher's top-K), every
parameter's gradient of one backward of the composed RL objective (PPO + k3 KL + entropy bonus,
two micro-batches) and a full train step's loss and gradient norm agree within FUSED_TOL; the
fused pass really ran without logits (the output layer returned hidden states), 'auto' falls back
to the logits for an objective that reads them and 'on' refuses it naming the reason, as it
refuses a hooked output layer.
``<model>``: dense, moe or a key of dist_cases.VARIANTS (tied1002: tied embeddings).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# fp32: the fused op sums the same products in another order (chunked matmuls, per-chunk maxima)
FUSED_TOL = 2e-5

_OBJECTIVE = dict(policy_loss="ppo", kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01)


def _grads(ln) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in ln.model.named_parameters() if p.requires_grad}


def case_fused(args, model: str, layout_name: str) -> dict:
    from megarl.objectives.rl_objective import ObjectiveConfig, RLObjective
    from tests.learner.dist_cases import (
        LAYOUTS,
        VARIANTS,
        dp_shard,
        learner_for,
        make_batch,
        make_hf_model,
        make_variant_hf,
        max_over_world,
    )

    if model in VARIANTS:
        _, d = make_variant_hf(model, args.workdir)
        vocab = VARIANTS[model][1].get("vocab_size", 256)
    else:
        _, d = make_hf_model(model == "moe", args.workdir)
        vocab = 256
    ln = learner_for(LAYOUTS[layout_name], d)
    batch = make_batch(41, lens=(7, 13, 5, 9, 6, 8), vocab=vocab)
    lp0, _ = ln.compute_logprobs(batch)
    g = torch.Generator().manual_seed(3)
    m = batch.loss_mask
    batch.old_logprobs = torch.clamp(lp0 + 0.2 * torch.randn(lp0.shape, generator=g), max=0.0) * m
    batch.ref_logprobs = torch.clamp(lp0 + 0.2 * torch.randn(lp0.shape, generator=g), max=0.0) * m
    shard = dp_shard(batch, ln)
    objective = RLObjective(ObjectiveConfig(**_OBJECTIVE))
    out: dict = {}
    tops: dict = {}
    for mode in ("off", "on"):
        ln.fused.mode = mode
        lp, ent = ln.compute_logprobs(batch, num_micro_batches=2, with_entropy=True)
        top = ln.compute_topk_logprobs(batch, 5, num_micro_batches=2)
        tops[mode] = top
        ln.backward_pass(shard, objective, num_micro_batches=2)
        grads = _grads(ln)
        ln.load_hf(d)  # the train step starts from the same weights in both modes
        metrics = ln.train_step(shard, objective, num_micro_batches=2)
        ln.load_hf(d)
        out[mode] = (lp, ent, grads, metrics)
    ran_fused = ln.fused._bypass is not None and ln.fused._bypass.weight is not None
    (lp_a, ent_a, g_a, m_a), (lp_b, ent_b, g_b, m_b) = out["off"], out["on"]
    d_lp = max_over_world(float((lp_a - lp_b).abs().max()))
    d_ent = max_over_world(float((ent_a - ent_b).abs().max()))
    scale = max_over_world(max(float(v.abs().max()) for v in g_a.values()))
    d_grad = max_over_world(max(float((g_a[k] - g_b[k]).abs().max()) for k in g_a))
    # a teacher's top-K input without its logits goes through the (fused) top-K pass
    from megarl.plugin.teacher_pass import MegatronTeacherPass

    ln.fused.mode = "auto"
    filled = batch.select(list(range(batch.num_seqs)))
    MegatronTeacherPass(ln, frozenset({"teacher_topk"}), top_k=5).fill(filled, 2)
    d_topk, topk_ids_equal = 0.0, True
    if tops["off"] is not None:  # last stage; rows of first tokens (zero logits: all tied) unused
        rows = torch.ones(batch.num_tokens, dtype=torch.bool)
        rows[batch.cu_seqlens[:-1]] = False
        for ids, lp in (
            tops["on"],
            (filled.token_extras["teacher_topk_ids"], filled.token_extras["teacher_topk_logprobs"]),
        ):
            topk_ids_equal &= torch.equal(tops["off"][0][rows], ids[rows])
            d_topk = max(d_topk, float((tops["off"][1][rows] - lp[rows]).abs().max()))
    d_topk = max_over_world(d_topk + (0.0 if topk_ids_equal else 1e9))
    d_loss = abs(m_a["loss"] - m_b["loss"])
    d_gn = abs(m_a["grad_norm"] - m_b["grad_norm"]) / max(m_a["grad_norm"], 1e-12)

    # auto keeps the logits for an objective that reads them; on refuses it, naming the reason
    full_vocab = RLObjective(ObjectiveConfig(**_OBJECTIVE, distill="forward_kl", distill_coef=0.1))
    ln.fused.mode = "auto"
    auto_full = ln.fused.enabled(full_vocab)
    auto_plain = ln.fused.enabled(objective)
    ln.fused.mode = "on"
    try:
        ln.fused.enabled(full_vocab)
        refused = ""
    except ValueError as e:
        refused = str(e)
    # a hook on the output layer (it would see no logits) turns the fusion off / is refused
    hooked_refused = ""
    if ln.groups.is_last_stage:
        h = ln.model.output_layer.register_forward_hook(lambda *a: None)
        try:
            ln.fused.enabled(objective)
        except ValueError as e:
            hooked_refused = str(e)
        h.remove()
    ln.fused.mode = "auto"
    last = ln.groups.is_last_stage
    ok_flags = torch.tensor(
        [float(ran_fused or not last), float(bool(hooked_refused) or not last)], dtype=torch.float64
    )
    dist.all_reduce(ok_flags, op=dist.ReduceOp.MIN)
    return {
        "d_logprobs": d_lp,
        "d_entropy": d_ent,
        "d_grad": d_grad,
        "grad_scale": scale,
        "d_topk_logprobs": d_topk,
        "d_loss": d_loss,
        "d_grad_norm_rel": d_gn,
        "auto_full_vocab": auto_full,
        "auto_plain": auto_plain,
        "refused": refused,
        "hooked_refused": hooked_refused,
        "ok": d_lp <= FUSED_TOL
        and d_ent <= FUSED_TOL
        and d_grad <= FUSED_TOL * max(scale, 1.0)
        and d_loss <= FUSED_TOL
        and d_topk <= FUSED_TOL
        and d_gn <= FUSED_TOL
        and not auto_full
        and auto_plain
        and "reads the full logits" in refused
        and bool(ok_flags.min() == 1.0),
    }


CASES = {"fused": case_fused}
