"""A value head on the policy's own trunk (megarl/learner/heads.py) under real megatron-core + gloo
(cases for tests/learner/dist_cases.py, asserted by test_learner_dist.py).

``sharedhead``: policy loss (PPO) + c_v · clipped value loss (the ``value_head`` regulariser)
through ONE backward equals a plain-PyTorch reference on transformers' model with a value
projection of its final normed hidden states: the head's values, the loss, and the gradient of
every HF parameter and of the head (trunk gradients include the value term: checked against the
reference without it too); PP 2 on the logits path (fused_output off), the other layouts on the
fused output layer. Then one optimizer step moves the head; checkpoint save/load restores
every parameter (head included) bit for bit and the next step equals the uninterrupted one; HF
export carries exactly the head-less model's names, equal to a head-less learner's export.
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist

C_V = float(os.environ.get("SH_CV", "0.5"))
REG = {"name": "value_head", "coef": C_V, "value_loss": "clipped", "value_clip": 0.2}
GRAD_TOL = 2e-5  # relative to the largest reference gradient entry (fp32 vs fp32 on other kernels)


def _head_learner(layout, d: str, fused_output: str = "auto"):
    from megarl.learner.learner import Learner, LearnerConfig
    from megarl.learner.optim_config import OptimConfig
    from megarl.learner.parallel import initialize_parallel

    ln = Learner(
        LearnerConfig(
            hf_config=d,
            optim=OptimConfig(lr=1e-3, clip_grad=0.0, adam_eps=1e-6),
            moe_aux_loss_coeff=0.0,
            heads=("value",),
            fused_output=fused_output,
        ),
        initialize_parallel(layout),
    )
    ln.load_hf(d)
    return ln


def _set_head(ln, w: torch.Tensor, b: torch.Tensor) -> None:
    """Non-zero head weights (a zero head sends no value gradient into the trunk)."""
    if ln.groups.is_last_stage:
        head = ln.model.megarl_heads["value"]
        with torch.no_grad():
            head.weight.copy_(w)
            head.bias.copy_(b)
    ln.sync_main_params()


def _hf_grads(ln) -> dict[str, torch.Tensor]:
    """The summed (over data-parallel replicas) gradients of ``backward_pass``, as HF-named tensors
    (every rank), plus the head's under ``head.weight`` / ``head.bias``."""
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    from megarl.convert.hf_megatron import iter_hf_tensors

    g = ln.groups
    if g.layout.tp > 1:  # what a training step's finalize does: partial norm grads summed over TP
        _allreduce_non_tensor_model_parallel_grads([ln.ddp], ln.config, g.tp)
    saved = {}
    for name, p in ln.model.named_parameters():
        grad = p.main_grad.detach().clone()
        group = g.dp_cp if getattr(p, "allreduce", True) else g.expt_dp
        if dist.get_world_size(group) > 1:
            dist.all_reduce(grad, group=group)
        saved[name] = p.data.clone()
        p.data.copy_(grad)
    head = torch.zeros(ln.model.config.hidden_size + 1)
    if g.is_last_stage:
        h = ln.model.megarl_heads["value"]
        head = torch.cat([h.weight.data.reshape(-1), h.bias.data.reshape(-1)]).float()
    head = ln._from_last_stage(head)
    out = {k: t.clone() for k, t in iter_hf_tensors(ln.model, g)}  # replicated ones alias the params
    out["head.weight"], out["head.bias"] = head[:-1].reshape(1, -1), head[-1:]
    for name, p in ln.model.named_parameters():
        p.data.copy_(saved[name])
    return out


def _reference(hf, batch, w, b, c_v: float):
    """(values [T], loss, gradients of the loss by HF name + head.weight/head.bias, the same of the
    policy loss alone): one forward, the two backward passes of torch.autograd.grad."""
    from megarl.batch import unpack
    from reference.critics import policy_and_value_loss

    w = w.clone().requires_grad_(True)
    b = b.clone().requires_grad_(True)
    captured: list = []
    hook = hf.model.norm.register_forward_hook(lambda m, i, o: captured.append(o))
    logits, values = [], []
    try:
        for a, e in itertools.pairwise(batch.cu_seqlens.tolist()):
            lg = hf(batch.tokens[None, a:e]).logits[0]
            h = captured.pop()[0]
            v = (h @ w.T + b)[:, 0]
            logits.append(torch.cat([lg.new_zeros(1, lg.shape[-1]), lg[:-1]]))
            values.append(torch.cat([v.new_zeros(1), v[:-1]]))
    finally:
        hook.remove()
    full, vals = torch.cat(logits), torch.cat(values)
    pad = unpack(batch)
    am = pad.attention_mask
    lg = torch.zeros(*am.shape, full.shape[-1])
    lg[am] = full
    vp = torch.zeros(am.shape)
    vp[am] = vals
    pt = pad.per_token
    parts = [
        policy_and_value_loss(
            lg,
            pad.tokens,
            pad.loss_mask,
            pt["advantages"],
            pt["old_logprobs"],
            vp,
            pt["values"],
            pt["returns"],
            coef,
            clip_low=0.2,
            clip_high=0.28,
            value_kind="clipped",
            value_clip=0.2,
        )
        for coef in (c_v, 0.0)
    ]
    names = [n for n, _ in hf.named_parameters()] + ["head.weight", "head.bias"]
    params = [p for _, p in hf.named_parameters()] + [w, b]
    out = []
    for i, loss in enumerate(parts):
        gs = torch.autograd.grad(loss, params, retain_graph=i == 0, allow_unused=True)
        out.append({n: g for n, g in zip(names, gs) if g is not None})
    return vals.detach(), float(parts[0]), out[0], out[1]


def case_sharedhead(args, moe: bool, layout_name: str, num_micro: int = 1) -> dict:
    """See the module docstring."""
    import megarl.methods.critics.shared  # noqa: F401  (registers the value_head regulariser)
    from megarl.convert.hf_megatron import iter_hf_tensors
    from megarl.learner.dist_checkpoint import load_checkpoint, save_checkpoint
    from megarl.objectives.api import GlobalNormalisers
    from megarl.objectives.rl_objective import ObjectiveConfig, RLObjective
    from tests.learner.dist_cases import (
        LAYOUTS,
        dp_shard,
        learner_for,
        make_batch,
        make_hf_model,
        max_over_world,
    )

    hf, d = make_hf_model(moe, args.workdir)
    layout = LAYOUTS[layout_name]
    # PP 2 takes the logits path, the others the fused output layer (value_head reads no logits)
    fused = "off" if layout_name == "pp2" else "auto"
    ln = _head_learner(layout, d, fused)
    full = layout_name == "tp2"  # checkpoint and export: one layout (CI time)
    exported_fresh = {k: t.clone() for k, t in iter_hf_tensors(ln.model, ln.groups)} if full else {}
    gen = torch.Generator().manual_seed(3)
    H = ln.model.config.hidden_size
    w, b = torch.randn(1, H, generator=gen) * 0.3, torch.randn(1, generator=gen) * 0.1
    _set_head(ln, w, b)
    batch = make_batch(31, lens=(7, 13, 5, 9, 6, 8, 10, 4))
    lp, _ = ln.compute_logprobs(batch)
    m = batch.loss_mask
    batch.old_logprobs = torch.clamp(lp + 0.3 * torch.randn(lp.shape, generator=gen), max=0.0) * m
    batch.values = 0.3 * torch.randn(batch.num_tokens, generator=gen) * m  # V_old
    batch.returns = torch.rand(batch.num_tokens, generator=gen) * m
    ref_v, ref_loss, ref_g, ref_g_policy = _reference(hf, batch, w, b, C_V)

    out: dict = {"fused_output": fused}
    values = ln.compute_head(batch, "value", num_micro)
    out["d_values"] = max_over_world(float((values - ref_v).abs().max()))

    objective = RLObjective(
        ObjectiveConfig(policy_loss="ppo", clip_low=0.2, clip_high=0.28, regularisers=[REG])
    )
    g = ln.groups
    local = dp_shard(batch, ln)
    norms = GlobalNormalisers.from_batch(local, g.dp if g.dp_size > 1 else None)
    ln.backward_pass(local, objective, num_micro, norms)
    grads = _hf_grads(ln)
    # transformers fuses an MoE layer's experts into one tensor: compare the per-expert names only
    # where it does not (attention, norms, router, dense MLP, output, head)
    common = sorted(set(ref_g) & set(grads))
    scale = max(float(ref_g[k].abs().max()) for k in common)
    per_key = {k: float((grads[k] - ref_g[k]).abs().max()) / scale for k in common}
    out["d_grad_rel"] = max_over_world(max(per_key.values()))
    out["grads_compared"] = len(common)
    out["grad_names_missing"] = [k for k in ref_g if k not in grads and ".experts." not in k]
    # the value term reaches the trunk: without it the trunk's gradient is measurably different
    trunk = [k for k in ref_g if not k.startswith("head.") and k != "lm_head.weight"]
    out["value_term_in_trunk_rel"] = (
        max(float((ref_g[k] - ref_g_policy[k]).abs().max()) for k in trunk) / scale
    )

    before = {n: p.detach().clone() for n, p in ln.model.named_parameters()}
    metrics = ln.train_step(local, objective, num_micro_batches=num_micro, normalisers=norms)
    out["d_loss"] = abs(metrics["loss"] - ref_loss)
    out["reg_value_head"] = metrics.get("reg/value_head")
    moved = [n for n, p in ln.model.named_parameters() if not torch.equal(p, before[n])]
    head_moved = float(any(n.startswith("megarl_heads.") for n in moved)) if g.is_last_stage else 1.0
    out["head_moved"] = -max_over_world(-head_moved)  # on every last stage

    ok = (
        out["d_values"] <= 1e-4
        and out["d_grad_rel"] <= GRAD_TOL
        and not out["grad_names_missing"]
        and out["value_term_in_trunk_rel"] > 1e-3
        and out["d_loss"] <= 1e-5
        and out["head_moved"] == 1.0
    )

    if full:
        # checkpoint: every parameter (head included) back bit for bit; the next step equal
        ckpt = os.path.join(args.workdir, f"ckpt-sharedhead-{'moe' if moe else 'dense'}-{layout_name}")
        save_checkpoint(ln, ckpt)
        m_ref = ln.train_step(local, objective, num_micro_batches=num_micro, normalisers=norms)
        p_ref = {n: p.detach().clone() for n, p in ln.model.named_parameters()}
        ln2 = _head_learner(layout, d)
        load_checkpoint(ln2, ckpt)
        saved_params = {n: p.detach().clone() for n, p in ln2.model.named_parameters()}
        m2 = ln2.train_step(local, objective, num_micro_batches=num_micro, normalisers=norms)
        diffs = [n for n, p in ln2.model.named_parameters() if not torch.equal(p, p_ref[n])]
        out["ckpt_head_keys"] = sorted(n for n in saved_params if n.startswith("megarl_heads."))
        out["ckpt_param_diffs"] = int(max_over_world(float(len(diffs))))
        out["ckpt_d_loss"] = abs(m2["loss"] - m_ref["loss"])
        want_keys = ["megarl_heads.value.bias", "megarl_heads.value.weight"] if g.is_last_stage else []
        ok = ok and out["ckpt_param_diffs"] == 0 and out["ckpt_d_loss"] == 0.0
        ok = ok and out["ckpt_head_keys"] == want_keys

        # HF export: the head-less model's names, equal to a head-less learner's export
        plain = learner_for(layout, d)
        exported = dict(iter_hf_tensors(ln2.model, g))
        plain_export = dict(iter_hf_tensors(plain.model, g))
        out["export_names_equal"] = list(exported) == list(plain_export)
        out["export_fresh_equal"] = all(torch.equal(exported_fresh[k], plain_export[k]) for k in plain_export)
        ok = ok and out["export_names_equal"] and out["export_fresh_equal"]
    out["ok"] = bool(ok)
    return out


CASES = {"sharedhead": case_sharedhead}
