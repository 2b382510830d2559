"""Distributed learner checks, many per process-group start.

Run as ``torchrun --nproc-per-node N tests/learner/dist_cases.py --workdir DIR --cases a,b,...``.
Every case runs on every rank (switching parallel layouts inside, groups are re-created, the
default process group stays), and rank 0 prints one line ``CASE {json}`` per case with the
measured numbers and ``ok``. tests/learner/test_learner_dist.py launches this and asserts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megarl.batch import PackedBatch
from megarl.catalogue import load_builtin

load_builtin()
from megarl.convert.hf_megatron import ConversionError, iter_hf_tensors, load_hf_into_model  # noqa: E402
from megarl.learner.learner import Learner, LearnerConfig, OptimConfig  # noqa: E402
from megarl.learner.parallel import ParallelLayout, init_distributed, initialize_parallel  # noqa: E402
from megarl.objectives.api import LossContext, LossOutput  # noqa: E402
from megarl.ops.vocab_parallel import vocab_parallel_logprobs_entropy  # noqa: E402

VOCAB = 256
PARITY_TOL = 1e-4
# Adam turns gradient differences of ~1e-7 on near-zero gradients into update differences of a few
# % of lr (1e-3); 2 steps: 3e-5 = 3% of one step.
PARAM_TOL = 3e-5


# ----------------------------------------------------------------------------- fixtures
def tiny_hf_config(moe: bool, aux: float = 0.0) -> dict:
    """A tiny Qwen3 / Qwen3-MoE config (transformers config kwargs)."""
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )
    if moe:
        base.update(
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            router_aux_loss_coef=aux,
        )
    return base


def make_hf_model(moe: bool, workdir: str):
    """Random-weight HF model, saved once (rank 0) to workdir; returns (model, dir)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(1 if moe else 0)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**tiny_hf_config(True)))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**tiny_hf_config(False)))
    model = model.float().eval()
    d = os.path.join(workdir, "hf_moe" if moe else "hf_dense")
    if dist.get_rank() == 0 and not os.path.exists(d):
        model.save_pretrained(d)
    dist.barrier()
    return model, d


def make_batch(
    seed: int, lens=(7, 13, 5, 9), prompt=3, vocab: int = VOCAB, rollout_logprobs=False
) -> PackedBatch:
    """A packed batch of len(lens) sequences with random tokens and advantages (same on all ranks);
    ``rollout_logprobs``: also random engine logprobs in [-4, 0]."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = torch.zeros(len(lens) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    mask = torch.zeros(T)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        mask[a + prompt : b] = 1.0
    return PackedBatch(
        tokens=torch.randint(0, vocab, (T,), generator=g),
        cu_seqlens=cu,
        prompt_lens=torch.full((len(lens),), prompt),
        loss_mask=mask,
        group_ids=torch.arange(len(lens)) // 2,
        advantages=torch.randn(T, generator=g),
        rollout_logprobs=-torch.rand(T, generator=g) * 4 if rollout_logprobs else None,
    ).validate()


class PolicyGradientObjective:
    """Test objective: token-mean of -logprob * advantage, plus an entropy metric."""

    def __call__(self, logits: torch.Tensor, batch: PackedBatch, ctx: LossContext) -> LossOutput:
        lp, ent = vocab_parallel_logprobs_entropy(
            logits, batch.tokens.to(logits.device), ctx.tp_group, ctx.chunk_tokens
        )
        m = batch.loss_mask.to(lp)
        n = ctx.normalisers.num_tokens
        loss = -(lp * batch.advantages.to(lp) * m).sum() / n
        return LossOutput(
            loss=loss, metrics={"pg_loss": loss.detach(), "entropy": (ent * m).sum().detach() / n}
        )


def learner_for(
    layout: ParallelLayout, hf_dir: str, optim: OptimConfig | None = None, aux: float | None = 0.0
) -> Learner:
    groups = initialize_parallel(layout)
    ln = Learner(
        LearnerConfig(
            hf_config=hf_dir,
            optim=optim or OptimConfig(lr=1e-3, clip_grad=1.0, adam_eps=1e-6),
            moe_aux_loss_coeff=aux,
        ),
        groups,
    )
    ln.load_hf(hf_dir)
    return ln


def dp_shard(batch: PackedBatch, ln: Learner) -> PackedBatch:
    g = ln.groups
    return batch.split(g.dp_size)[g.dp_rank] if g.dp_size > 1 else batch


def last_stage_logits(ln: Learner, batch: PackedBatch) -> torch.Tensor | None:
    """Unaligned logits [T, V/tp] via the forward-only schedule (works for any PP)."""

    def loss_func(mb, logits):
        return logits.new_zeros(()), torch.tensor(1, dtype=torch.int), {"logits": logits[: mb.num_tokens]}

    with torch.no_grad():
        out = ln._run_schedule([batch], loss_func, forward_only=True)
    return out[0]["logits"] if ln.groups.is_last_stage else None


def hf_logits_per_seq(hf, batch: PackedBatch) -> torch.Tensor:
    cu = batch.cu_seqlens.tolist()
    with torch.no_grad():
        return torch.cat([hf(batch.tokens[None, a:b]).logits[0] for a, b in itertools.pairwise(cu)])


def max_over_world(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


LAYOUTS = {
    "tp1": ParallelLayout(),
    "tp2": ParallelLayout(tp=2),
    "tp2sp": ParallelLayout(tp=2, sequence_parallel=True),
    "pp2": ParallelLayout(pp=2),
    "ep2": ParallelLayout(ep=2),
    "tp2ep2": ParallelLayout(tp=2, ep=2, sequence_parallel=True, expert_tp=1),
    "cp2": ParallelLayout(cp=2),
    # four ranks
    "tp2pp2": ParallelLayout(tp=2, pp=2),
    "tp2ep2dp2": ParallelLayout(tp=2, ep=2, sequence_parallel=True, expert_tp=1),
    "tp2pp2ep2": ParallelLayout(tp=2, pp=2, ep=2, sequence_parallel=True, expert_tp=1),
    "tp2cp2": ParallelLayout(tp=2, cp=2, sequence_parallel=True),
    "pp2cp2": ParallelLayout(pp=2, cp=2),
    "ep2cp2": ParallelLayout(ep=2, cp=2, expert_tp=1),
}


# ----------------------------------------------------------------------------- cases
def case_parity(args, moe: bool, layout_name: str) -> dict:
    """Megatron logits (this rank's vocab shard) vs transformers, same packed batch."""
    hf, d = make_hf_model(moe, args.workdir)
    ln = learner_for(LAYOUTS[layout_name], d)
    batch = make_batch(3)
    ref = hf_logits_per_seq(hf, batch)
    out = last_stage_logits(ln, batch)
    diff = 0.0
    if out is not None:
        V = VOCAB // ln.groups.layout.tp
        r = ln.groups.tp_rank
        diff = float((out - ref[:, r * V : (r + 1) * V]).abs().max())
    diff = max_over_world(diff)
    return {"max_abs_diff": diff, "ok": diff <= PARITY_TOL}


def case_roundtrip(args, moe: bool, layout_name: str) -> dict:
    """HF -> Megatron (sharded) -> HF export is bit-exact, all tensors, on every rank."""
    from safetensors import safe_open

    _, d = make_hf_model(moe, args.workdir)
    ln = learner_for(LAYOUTS[layout_name], d)
    exported = dict(iter_hf_tensors(ln.model, ln.groups))
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        bad = [k for k in keys if k not in exported or not torch.equal(f.get_tensor(k), exported[k])]
    extra = sorted(set(exported) - keys)
    nbad = max_over_world(len(bad) + len(extra))
    return {"num_tensors": len(exported), "mismatched": bad[:5], "extra": extra[:5], "ok": nbad == 0}


def case_corrupt(args, moe: bool, layout_name: str) -> dict:
    """Deliberately corrupted key sets raise ConversionError naming the keys."""
    from safetensors.torch import load_file

    _, d = make_hf_model(moe, args.workdir)
    groups = initialize_parallel(LAYOUTS[layout_name])
    from megarl.learner.model import build_gpt_model

    model = build_gpt_model(d, groups)
    sd = load_file(os.path.join(d, "model.safetensors"))
    results = {}
    variants = {
        "missing": (
            {k: v for k, v in sd.items() if k != "model.layers.1.self_attn.k_proj.weight"},
            "model.layers.1.self_attn.k_proj.weight",
        ),
        "unknown": (
            dict(sd, **{"model.layers.0.mlp.extra_bias": torch.zeros(3)}),
            "model.layers.0.mlp.extra_bias",
        ),
        "unused": (
            dict(sd, **{"model.layers.7.input_layernorm.weight": torch.zeros(64)}),
            "model.layers.7.input_layernorm.weight",
        ),
        "shape": (dict(sd, **{"model.norm.weight": torch.zeros(63)}), "model.norm.weight"),
    }
    for name, (bad_sd, key) in variants.items():
        try:
            load_hf_into_model(model, groups, bad_sd)
            results[name] = "no error"
        except ConversionError as e:
            results[name] = "ok" if key in str(e) else f"message lacks key: {e}"
    return {"results": results, "ok": all(v == "ok" for v in results.values())}


def case_logprobs(args, moe: bool, layout_name: str) -> dict:
    """compute_logprobs (vocab-parallel, aligned) vs log_softmax of HF logits; packed vs one-at-a-time."""
    hf, d = make_hf_model(moe, args.workdir)
    ln = learner_for(LAYOUTS[layout_name], d)
    batch = make_batch(5)
    lp, ent = ln.compute_logprobs(batch, num_micro_batches=2, with_entropy=True)
    ref = torch.log_softmax(hf_logits_per_seq(hf, batch), -1)
    cu = batch.cu_seqlens
    ref_lp = torch.zeros_like(lp)
    ref_ent = torch.zeros_like(lp)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref_lp[a + 1 : b] = ref[a : b - 1].gather(-1, batch.tokens[a + 1 : b, None])[:, 0]
        ref_ent[a + 1 : b] = -(ref[a : b - 1].exp() * ref[a : b - 1]).sum(-1)
    single = torch.cat([ln.compute_logprobs(batch.select([i]))[0] for i in range(batch.num_seqs)])
    d_hf = float((lp - ref_lp).abs().max())
    d_ent = float((ent - ref_ent).abs().max())
    d_single = float((lp - single).abs().max())
    return {
        "vs_hf": d_hf,
        "entropy_vs_hf": d_ent,
        "packed_vs_single": d_single,
        "ok": d_hf <= PARITY_TOL and d_ent <= PARITY_TOL and d_single <= 1e-5,
    }


def case_frozen(args, moe: bool, layout_name: str) -> dict:
    """A forward-only learner (the KL reference): same logprobs as a trainable one, no optimizer, no
    gradient buffers, and train_step refuses."""
    _, d = make_hf_model(moe, args.workdir)
    groups = initialize_parallel(LAYOUTS[layout_name])
    full = Learner(LearnerConfig(hf_config=d), groups)
    full.load_hf(d)
    frozen = Learner(LearnerConfig(hf_config=d, trainable=False), groups)
    frozen.load_hf(d)
    batch = make_batch(7)
    diff = float((full.compute_logprobs(batch)[0] - frozen.compute_logprobs(batch)[0]).abs().max())
    grad_buffers = sum(b.grad_data.numel() for b in frozen.ddp.buffers + frozen.ddp.expert_parallel_buffers)
    full_buffers = sum(b.grad_data.numel() for b in full.ddp.buffers + full.ddp.expert_parallel_buffers)
    try:
        frozen.train_step(batch, PolicyGradientObjective())
        refused = False
    except RuntimeError:
        refused = True
    return {
        "logprob_diff": diff,
        "grad_buffer_elems": grad_buffers,
        "trainable_grad_buffer_elems": full_buffers,
        "ok": diff <= 1e-5
        and frozen.optimizer is None
        and grad_buffers == 0
        and full_buffers > 0
        and refused,
    }


_REF: dict = {}


def _train_once(args, layout_name: str, moe: bool, num_micro: int, steps: int = 1):
    _, d = make_hf_model(moe, args.workdir)
    ln = learner_for(LAYOUTS[layout_name], d)
    batch = make_batch(11, lens=(7, 13, 5, 9, 6, 8, 10, 4))
    metrics = []
    for _ in range(steps):
        metrics.append(
            ln.train_step(dp_shard(batch, ln), PolicyGradientObjective(), num_micro_batches=num_micro)
        )
    params = dict(iter_hf_tensors(ln.model, ln.groups))
    return metrics, params


def case_invariance(args, moe: bool, layout_name: str, num_micro: int = 2) -> dict:
    """Same global batch and weights -> same loss, grad norm, updated params as the reference layout
    (tp1 with DP over the world, one micro-batch). The first call records the reference."""
    key = "moe" if moe else "dense"
    if key not in _REF:
        _REF[key] = _train_once(args, "tp1", moe, 1, steps=2)
    ref_m, ref_p = _REF[key]
    m, p = _train_once(args, layout_name, moe, num_micro, steps=2)
    d_loss = max(abs(a["loss"] - b["loss"]) for a, b in zip(m, ref_m))
    d_gn = max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(m, ref_m))
    d_par = max(float((p[k] - ref_p[k]).abs().max()) for k in ref_p)
    d_par = max_over_world(d_par)
    return {
        "loss": [x["loss"] for x in m],
        "grad_norm": [x["grad_norm"] for x in m],
        "d_loss": d_loss,
        "d_grad_norm": d_gn,
        "d_params": d_par,
        "ok": d_loss <= 1e-5 and d_gn <= 1e-5 * max(1.0, ref_m[0]["grad_norm"]) and d_par <= PARAM_TOL,
    }


def case_checkpoint(args, moe: bool, layout_name: str, load_layout: str | None = None) -> dict:
    """save -> load -> one more step equals the uninterrupted run; load under ``load_layout``."""
    from megarl.learner.dist_checkpoint import load_checkpoint, save_checkpoint

    _, d = make_hf_model(moe, args.workdir)
    batch = make_batch(11, lens=(7, 13, 5, 9, 6, 8, 10, 4))
    ckpt = os.path.join(args.workdir, f"ckpt-{'moe' if moe else 'dense'}-{layout_name}-{load_layout}")
    ln = learner_for(
        LAYOUTS[layout_name],
        d,
        optim=OptimConfig(
            lr=1e-3, adam_eps=1e-6, lr_warmup_steps=1, lr_decay_steps=5, lr_decay_style="cosine"
        ),
    )
    ln.train_step(dp_shard(batch, ln), PolicyGradientObjective(), num_micro_batches=1)
    save_checkpoint(ln, ckpt)
    m_ref = ln.train_step(dp_shard(batch, ln), PolicyGradientObjective(), num_micro_batches=1)
    p_ref = dict(iter_hf_tensors(ln.model, ln.groups))
    ln2 = learner_for(
        LAYOUTS[load_layout or layout_name],
        d,
        optim=OptimConfig(
            lr=1e-3, adam_eps=1e-6, lr_warmup_steps=1, lr_decay_steps=5, lr_decay_style="cosine"
        ),
    )
    meta = load_checkpoint(ln2, ckpt)
    m = ln2.train_step(dp_shard(batch, ln2), PolicyGradientObjective(), num_micro_batches=1)
    p = dict(iter_hf_tensors(ln2.model, ln2.groups))
    d_par = max_over_world(max(float((p[k] - p_ref[k]).abs().max()) for k in p_ref))
    same = load_layout in (None, layout_name)
    tol = 0.0 if same else PARAM_TOL
    res = {
        "step": ln2.step,
        "lr": [m_ref["lr"], m["lr"]],
        "loss": [m_ref["loss"], m["loss"]],
        "d_params": d_par,
        "d_loss": abs(m["loss"] - m_ref["loss"]),
        "rng_restored": meta["rng_restored"],
        "tmp_left": os.path.exists(ckpt + ".tmp-megarl"),
    }
    res["ok"] = (
        d_par <= tol
        and res["d_loss"] <= (0.0 if same else 1e-5)
        and ln2.step == 2
        and m["lr"] == m_ref["lr"]
        and not res["tmp_left"]
    )
    return res


def case_export(args, moe: bool, layout_name: str) -> dict:
    """Weight export for rollout engines: bucketed iterator (bounded size) and a safetensors directory
    that transformers loads and that reproduces the trained model's logprobs."""
    import json as _json

    from megarl.convert.hf_megatron import iter_hf_buckets, save_hf_checkpoint

    _hf, d = make_hf_model(moe, args.workdir)
    ln = learner_for(LAYOUTS[layout_name], d)
    batch = make_batch(11, lens=(7, 13, 5, 9, 6, 8, 10, 4))
    ln.train_step(dp_shard(batch, ln), PolicyGradientObjective())
    bucket_bytes = 40_000
    sizes = [
        sum(t.numel() * t.element_size() for t in b.values())
        for b in iter_hf_buckets(ln.model, ln.groups, bucket_bytes)
    ]
    biggest_tensor = max(t.numel() * t.element_size() for _, t in iter_hf_tensors(ln.model, ln.groups))
    out = os.path.join(args.workdir, f"export-{'moe' if moe else 'dense'}-{layout_name}")
    hf_cfg = _json.load(open(os.path.join(d, "config.json")))
    save_hf_checkpoint(ln.model, ln.groups, out, hf_config=hf_cfg, bucket_bytes=bucket_bytes)
    # reload the exported dir with transformers and compare logprobs with the learner's
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    probe = make_batch(21)
    lp, _ = ln.compute_logprobs(probe)
    ref = torch.log_softmax(hf_logits_per_seq(reloaded, probe), -1)
    ref_lp = torch.zeros_like(lp)
    cu = probe.cu_seqlens.tolist()
    for a, b in itertools.pairwise(cu):
        ref_lp[a + 1 : b] = ref[a : b - 1].gather(-1, probe.tokens[a + 1 : b, None])[:, 0]
    diff = float((lp - ref_lp).abs().max())
    ok_sizes = all(s <= max(bucket_bytes, biggest_tensor) for s in sizes)
    n_files = len([f for f in os.listdir(out) if f.endswith(".safetensors")])
    return {
        "num_buckets": len(sizes),
        "max_bucket_bytes": max(sizes),
        "bucket_bytes": bucket_bytes,
        "biggest_tensor_bytes": biggest_tensor,
        "files": n_files,
        "logprob_diff_vs_reloaded": diff,
        "ok": ok_sizes and len(sizes) > 1 and n_files == len(sizes) and diff <= PARITY_TOL,
    }


def case_objective(args, moe: bool, layout_name: str, num_micro: int = 2) -> dict:
    """The composed megarl objective inside the Megatron step (sharded logits, micro-batches, DP)
    reports the same loss as reference/loss.py:rl_loss on the gathered full-vocabulary logits."""
    from megarl.batch import unpack
    from megarl.objectives.rl_objective import ObjectiveConfig, RLObjective
    from reference.loss import rl_loss

    _, d = make_hf_model(moe, args.workdir)
    ln = learner_for(LAYOUTS[layout_name], d)
    batch = make_batch(31, lens=(7, 13, 5, 9, 6, 8, 10, 4))
    lp, _ = ln.compute_logprobs(batch)
    g = torch.Generator().manual_seed(7)
    m = batch.loss_mask
    batch.old_logprobs = torch.clamp(lp + 0.3 * torch.randn(lp.shape, generator=g), max=0.0) * m
    batch.ref_logprobs = torch.clamp(lp + 0.2 * torch.randn(lp.shape, generator=g), max=0.0) * m
    cfg = dict(
        policy_loss="ppo", clip_low=0.2, clip_high=0.28, kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01
    )
    # gathered full logits of the current weights, aligned, on the last stage
    logits = last_stage_logits(ln, batch)
    ref_loss = 0.0
    if logits is not None:
        tp = ln.groups.layout.tp
        if tp > 1:
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.contiguous(), group=ln.groups.tp)
            logits = torch.cat(parts, -1)
        from megarl.learner.forward import align_logits

        full = align_logits(logits, batch.cu_seqlens)  # [T, V]
        padded = unpack(batch)
        am = padded.attention_mask
        lg = torch.zeros(*am.shape, full.shape[-1])
        lg[am] = full
        pt = padded.per_token
        ref_loss = float(
            rl_loss(
                lg.double(),
                padded.tokens,
                padded.loss_mask.double(),
                pt["advantages"].double(),
                pt["old_logprobs"].double(),
                ref_logp=pt["ref_logprobs"].double(),
                clip_low=cfg["clip_low"],
                clip_high=cfg["clip_high"],
                kl_coef=cfg["kl_coef"],
                kl_estimator="k3",
                entropy_coef=cfg["entropy_coef"],
            )
        )
    ref_loss = float(ln._from_last_stage(torch.tensor([ref_loss], dtype=torch.float64)))
    metrics = ln.train_step(
        dp_shard(batch, ln), RLObjective(ObjectiveConfig(**cfg)), num_micro_batches=num_micro
    )
    diff = abs(metrics["loss"] - ref_loss)
    return {
        "megatron_loss": metrics["loss"],
        "reference_loss": ref_loss,
        "diff": diff,
        "metrics": sorted(metrics),
        "ok": diff <= 1e-5 and "clip_frac" in metrics and "kl" in metrics,
    }


def case_replay(args, moe: bool, layout_name: str, num_micro: int = 2) -> dict:
    """R3: routes recorded, weights changed so fresh routing differs, then the training forward with
    replay on uses exactly the recorded experts (checked on the routers' own routing maps)."""
    _, d = make_hf_model(True, args.workdir)
    groups = initialize_parallel(LAYOUTS[layout_name])
    ln = Learner(
        LearnerConfig(
            hf_config=d,
            optim=OptimConfig(lr=3e-2, clip_grad=0.0),
            moe_aux_loss_coeff=0.0,
            moe_routing_replay=True,
        ),
        groups,
    )
    ln.load_hf(d)
    batch = make_batch(41, lens=(7, 13, 5, 9, 6, 8, 10, 4))
    routes = ln.record_routes(batch, num_micro_batches=num_micro)
    # change the weights a lot, then see that fresh routing moved
    batch.routed_experts = routes
    ln.train_step(dp_shard(batch, ln), PolicyGradientObjective(), num_micro_batches=1)
    fresh = ln.record_routes(batch, num_micro_batches=num_micro)
    changed = int((fresh.sort(-1).values != routes.sort(-1).values).any(-1).sum())
    # capture what the routers actually chose during the replayed training forward
    seen: dict[int, list] = {}
    hooks = []
    from megarl.learner.routing_replay import local_token_slice

    for layer in ln.model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        moe_idx = ln.spec.moe_layers.index(layer.layer_number - 1)
        hooks.append(
            router.register_forward_hook(
                lambda mod, inp, out, i=moe_idx: seen.setdefault(i, []).append(out[1].detach().clone())
            )
        )
    shard = dp_shard(batch, ln)
    ln.train_step(shard, PolicyGradientObjective(), num_micro_batches=num_micro)
    for h in hooks:
        h.remove()
    mismatches = 0
    for moe_idx, maps in seen.items():
        for mb, rmap in zip(shard.split(num_micro), maps):
            T = mb.num_tokens
            pad_T = -(-T // ln._pad_multiple()) * ln._pad_multiple()
            sl = local_token_slice(pad_T, ln.groups)
            want = torch.zeros(pad_T, ln.spec.num_experts, dtype=torch.bool)
            want[torch.arange(T).unsqueeze(1), mb.routed_experts[:, moe_idx, :]] = True
            got = rmap.reshape(-1, ln.spec.num_experts).cpu()
            real = torch.arange(pad_T)[sl] < T
            mismatches += int((got[real] != want[sl][real]).any(-1).sum())
    mismatches = int(max_over_world(mismatches))
    changed = int(max_over_world(changed))
    return {
        "tokens_with_changed_fresh_routing": changed,
        "replay_mismatches": mismatches,
        "layers_seen": sorted(seen),
        "ok": changed > 0 and mismatches == 0 and len(seen) > 0,
    }


def _critic_once(args, layout_name: str, moe: bool, num_micro: int):
    """Two value-loss steps of a critic (value head, trunk from the HF model) on one global batch;
    (reported value losses, values before, values after, reference losses from reference/critics)."""
    import json

    from megarl.learner.value_model import build_value_learner, compute_values
    from megarl.objectives.value_losses import ValueObjective
    from reference.critics import value_loss

    _, d = make_hf_model(moe, args.workdir)
    with open(os.path.join(d, "config.json")) as f:
        hf = json.load(f)
    groups = initialize_parallel(LAYOUTS[layout_name])
    ln = build_value_learner(hf, groups, OptimConfig(lr=1e-2, clip_grad=1.0, adam_eps=1e-6), d)
    batch = make_batch(11, lens=(7, 13, 5, 9, 6, 8, 10, 4))
    g = torch.Generator().manual_seed(5)
    batch.returns = torch.rand(batch.num_tokens, generator=g) * batch.loss_mask
    batch.values = 0.3 * torch.randn(batch.num_tokens, generator=g) * batch.loss_mask  # V_old
    before = compute_values(ln, batch)
    objective = ValueObjective("clipped", clip=0.2)
    losses, ref = [], []
    for _ in range(2):
        now = compute_values(ln, batch)
        ref.append(float(value_loss(now, batch.values, batch.returns, batch.loss_mask, "clipped", 0.2)))
        losses.append(ln.train_step(dp_shard(batch, ln), objective, num_micro_batches=num_micro))
    return losses, before, compute_values(ln, batch), ref


def case_critic(args, moe: bool, layout_name: str, num_micro: int = 2) -> dict:
    """A critic under ``layout_name`` matches the tp1 reference layout (DP over the world, one
    micro-batch): value losses, grad norms and values after two steps; the reported value loss equals
    reference/critics.value_loss on the critic's own values; the values moved."""
    key = "critic-moe" if moe else "critic-dense"
    if key not in _REF:
        _REF[key] = _critic_once(args, "tp1", moe, 1)
    ref_m, _, ref_after, _ = _REF[key]
    m, before, after, ref_loss = _critic_once(args, layout_name, moe, num_micro)
    d_loss = max(abs(a["value_loss"] - b["value_loss"]) for a, b in zip(m, ref_m))
    d_ref = max(abs(a["value_loss"] - r) for a, r in zip(m, ref_loss))
    d_gn = max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(m, ref_m))
    d_val = max_over_world(float((after - ref_after).abs().max()))
    moved = float((after - before).abs().max())
    return {
        "value_loss": [x["value_loss"] for x in m],
        "grad_norm": [x["grad_norm"] for x in m],
        "d_value_loss": d_loss,
        "d_reference": d_ref,
        "d_grad_norm": d_gn,
        "d_values": d_val,
        "moved": moved,
        "ok": d_loss <= 1e-5 and d_ref <= 1e-5 and d_gn <= 1e-4 and d_val <= 1e-4 and moved > 1e-3,
    }


def case_critic_checkpoint(args, moe: bool, layout_name: str) -> dict:
    """A critic (value head on the trunk) saved after one value step with the run's sharded save and
    loaded into a fresh critic redoes the next step bit for bit: value loss, grad norm, every
    parameter (the value head's included) and the values; the LR schedule comes from the checkpoint."""
    import json

    from megarl.learner.dist_checkpoint import load_checkpoint, save_checkpoint
    from megarl.learner.value_model import build_value_learner, compute_values
    from megarl.objectives.value_losses import ValueObjective

    _, d = make_hf_model(moe, args.workdir)
    with open(os.path.join(d, "config.json")) as f:
        hf = json.load(f)
    groups = initialize_parallel(LAYOUTS[layout_name])
    optim = OptimConfig(lr=1e-2, clip_grad=1.0, adam_eps=1e-6, lr_warmup_steps=1, lr_decay_steps=4)
    batch = make_batch(11, lens=(7, 13, 5, 9, 6, 8, 10, 4))
    g = torch.Generator().manual_seed(5)
    batch.returns = torch.rand(batch.num_tokens, generator=g) * batch.loss_mask
    batch.values = 0.3 * torch.randn(batch.num_tokens, generator=g) * batch.loss_mask
    objective = ValueObjective("clipped", clip=0.2)
    ckpt = os.path.join(args.workdir, f"critic-ckpt-{'moe' if moe else 'dense'}-{layout_name}")
    a = build_value_learner(hf, groups, optim, d)
    a.train_step(dp_shard(batch, a), objective)
    save_checkpoint(a, ckpt)
    m_ref = a.train_step(dp_shard(batch, a), objective)
    p_ref = {n: t.detach().clone() for n, t in a.model.named_parameters()}
    v_ref = compute_values(a, batch)
    b = build_value_learner(hf, groups, OptimConfig(lr=1e-2, clip_grad=1.0, adam_eps=1e-6), None)
    load_checkpoint(b, ckpt)
    m = b.train_step(dp_shard(batch, b), objective)
    p = dict(b.model.named_parameters())
    d_par = max_over_world(max(float((p[n] - t).abs().max()) for n, t in p_ref.items()))
    d_val = max_over_world(float((compute_values(b, batch) - v_ref).abs().max()))
    res = {
        "value_loss": [m_ref["value_loss"], m["value_loss"]],
        "grad_norm": [m_ref["grad_norm"], m["grad_norm"]],
        "lr": [m_ref["lr"], m["lr"]],
        "d_params": d_par,
        "d_values": d_val,
        "params": len(p_ref),
    }
    res["ok"] = (
        m["value_loss"] == m_ref["value_loss"]
        and m["grad_norm"] == m_ref["grad_norm"]
        and m["lr"] == m_ref["lr"]
        and d_par == 0.0
        and d_val == 0.0
    )
    return res


def case_groups(args, moe: bool, layout_name: str) -> dict:
    """Switching layouts again and again, with a model built under each, must not pile up
    communicator threads: each layout's groups are made once per process and reused (megatron
    forgets its groups without freeing them, and models keep them alive)."""

    def threads() -> int:  # native threads too (gloo's are not Python threads)
        return len(os.listdir("/proc/self/task"))

    _, d = make_hf_model(moe, args.workdir)
    names = ["tp1", "ep2", "pp2", "tp2sp"] if moe else ["tp1", "tp2", "pp2", "tp2sp"]
    counts, same_groups = [], True
    first: dict[str, object] = {}
    for _ in range(3):
        for name in names:
            groups = initialize_parallel(LAYOUTS[name])
            same_groups &= first.setdefault(name, groups.tp) is groups.tp
            ln = learner_for(LAYOUTS[name], d)
            ln.compute_logprobs(make_batch(3))  # the groups work
        counts.append(threads())
    grown = int(max_over_world(counts[-1] - counts[0]))
    return {
        "threads_per_round": counts,
        "grown_after_first_round": grown,
        "groups_reused": same_groups,
        "ok": grown <= 4 and same_groups,
    }


# ----------------------------------------------------------------------------- config variants
# name -> (moe, overrides of tiny_hf_config). Hidden 48 makes vocab x hidden of 1002 not a multiple of
# 128 (the distributed optimizer pads its buckets to 128), that of 1024 a multiple.
VARIANTS: dict[str, tuple[bool, dict]] = {
    "tied1002": (False, dict(vocab_size=1002, hidden_size=48, tie_word_embeddings=True)),
    "untied1002": (False, dict(vocab_size=1002, hidden_size=48)),
    "tied1024": (False, dict(vocab_size=1024, hidden_size=48, tie_word_embeddings=True)),
    "untied1024": (False, dict(vocab_size=1024, hidden_size=48)),
    "gelutanh": (False, dict(hidden_act="gelu_pytorch_tanh")),
    "gelu": (False, dict(hidden_act="gelu")),
    "moe": (True, {}),
    "moedense": (True, dict(mlp_only_layers=[1])),  # layer 0 MoE, layer 1 dense
    "moesparse2": (True, dict(num_hidden_layers=4, decoder_sparse_step=2)),  # layers 1, 3 MoE
    "ffn129": (False, dict(intermediate_size=129)),  # not divisible by tp=2
    "moeffn33": (True, dict(moe_intermediate_size=33)),  # not divisible by expert tp=2
    "attnbias": (False, dict(attention_bias=True)),  # biases on q, k, v and o_proj
}


def make_variant_hf(variant: str, workdir: str):
    """Random-weight HF model of ``VARIANTS[variant]``, saved once (rank 0); returns (model, dir)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    moe, overrides = VARIANTS[variant]
    cfg = dict(tiny_hf_config(moe), **overrides)
    torch.manual_seed(2)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)) if moe else Qwen3ForCausalLM(Qwen3Config(**cfg))
    model = model.float().eval()
    d = os.path.join(workdir, f"hf-{variant}")
    if dist.get_rank() == 0 and not os.path.exists(d):
        model.save_pretrained(d)
    dist.barrier()
    return model, d


def hf_ref_logprobs(hf, batch: PackedBatch) -> torch.Tensor:
    """transformers' logprobs of ``batch.tokens`` in the batch convention (first token of each sequence 0)."""
    ref = torch.log_softmax(hf_logits_per_seq(hf, batch), -1)
    out = torch.zeros(batch.num_tokens)
    cu = batch.cu_seqlens.tolist()
    for a, b in itertools.pairwise(cu):
        out[a + 1 : b] = ref[a : b - 1].gather(-1, batch.tokens[a + 1 : b, None])[:, 0]
    return out


def _exported_mismatches(ln: Learner, hf_dir: str) -> list[str]:
    """HF tensor names whose export differs from the safetensors file (or is missing/extra), all ranks."""
    from safetensors import safe_open

    exported = dict(iter_hf_tensors(ln.model, ln.groups))
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        bad = [k for k in keys if k not in exported or not torch.equal(f.get_tensor(k), exported[k])]
    return bad + sorted(set(exported) - keys)


def case_variant_parity(args, variant: str, layout_name: str) -> dict:
    """A config variant: logprobs equal transformers', HF -> Megatron -> HF export bit-exact."""
    hf, d = make_variant_hf(variant, args.workdir)
    ln = learner_for(LAYOUTS[layout_name], d)
    batch = make_batch(5)
    lp, _ = ln.compute_logprobs(batch, num_micro_batches=2)
    diff = max_over_world(float((lp - hf_ref_logprobs(hf, batch)).abs().max()))
    bad = _exported_mismatches(ln, d)
    nbad = max_over_world(len(bad))
    return {
        "vs_hf": diff,
        "export_mismatched": bad[:5],
        "moe_layers": list(ln.spec.moe_layers),
        "ok": diff <= PARITY_TOL and nbad == 0,
    }


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Names of tensors of ``a`` not bit-equal in ``b``, with their max abs difference."""
    return {k: float((a[k] - b[k]).abs().max()) for k in a if not torch.equal(a[k], b[k])}


def case_checkpoint_exact(args, variant: str, layout_name: str, load_layout: str | None = None) -> dict:
    """After save -> load every parameter equals the saved one bit for bit (loaded in the same layout
    and in ``load_layout``); one more step then equals the uninterrupted run (bit-exact in the same
    layout, within PARAM_TOL after resharding)."""
    from megarl.learner.dist_checkpoint import load_checkpoint, save_checkpoint

    _, d = make_variant_hf(variant, args.workdir)
    batch = make_batch(11, lens=(7, 13, 5, 9, 6, 8, 10, 4))
    optim = OptimConfig(lr=1e-3, adam_eps=1e-6)
    ln = learner_for(LAYOUTS[layout_name], d, optim=optim)
    ln.train_step(dp_shard(batch, ln), PolicyGradientObjective())
    saved = {k: v.clone() for k, v in iter_hf_tensors(ln.model, ln.groups)}  # may be views of the params
    ckpt = os.path.join(args.workdir, f"ckexact-{variant}-{layout_name}")
    save_checkpoint(ln, ckpt)
    ln.train_step(dp_shard(batch, ln), PolicyGradientObjective())
    stepped = dict(iter_hf_tensors(ln.model, ln.groups))
    res: dict = {}
    ok = True
    for target in dict.fromkeys([layout_name, load_layout or layout_name]):
        ln2 = learner_for(LAYOUTS[target], d, optim=optim)
        load_checkpoint(ln2, ckpt)
        after_load = _differing(saved, dict(iter_hf_tensors(ln2.model, ln2.groups)))
        ln2.train_step(dp_shard(batch, ln2), PolicyGradientObjective())
        p = dict(iter_hf_tensors(ln2.model, ln2.groups))
        d_step = max(float((p[k] - stepped[k]).abs().max()) for k in stepped)
        n_bad = int(max_over_world(len(after_load)))
        d_step = max_over_world(d_step)
        tol = 0.0 if target == layout_name else PARAM_TOL
        res[target] = {
            "tensors": len(saved),
            "differ_after_load": n_bad,
            "max_diff_after_load": max(after_load.values(), default=0.0),
            "examples": sorted(after_load)[:3],
            "d_params_after_step": d_step,
        }
        ok &= n_bad == 0 and d_step <= tol
    res["ok"] = ok
    return res


def case_refused(args, variant: str, layout_name: str, key: str) -> dict:
    """Building a learner for the variant raises a ValueError whose message names ``key``."""
    _, d = make_variant_hf(variant, args.workdir)
    try:
        learner_for(LAYOUTS[layout_name], d)
        msg = "no error"
    except ValueError as e:
        msg = f"{type(e).__name__}: {e}"
    return {"message": msg, "ok": key in msg and msg != "no error"}


def case_checkpoint_refused(args, variant: str, layout_name: str, load_layout: str) -> dict:
    """The EP changes that are not supported are refused before any tensor is read, naming why:
    a checkpoint of the earlier optimizer format (its megarl.json has no optimizer_format), and a run
    without the distributed optimizer."""
    import json as _json

    from megarl.learner.dist_checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    _, d = make_variant_hf(variant, args.workdir)
    batch = make_batch(11, lens=(7, 13, 5, 9, 6, 8, 10, 4))
    results = {}
    for name, dist_opt in (("old_format", True), ("no_dist_optimizer", False)):
        optim = OptimConfig(lr=1e-3, adam_eps=1e-6, use_distributed_optimizer=dist_opt)
        ln = learner_for(LAYOUTS[layout_name], d, optim=optim)
        ln.train_step(dp_shard(batch, ln), PolicyGradientObjective())
        ckpt = os.path.join(args.workdir, f"ckrefuse-{variant}-{layout_name}-{name}")
        save_checkpoint(ln, ckpt)
        if name == "old_format" and dist.get_rank() == 0:
            meta_path = os.path.join(ckpt, "megarl.json")
            meta = _json.load(open(meta_path))
            meta.pop("optimizer_format")
            _json.dump(meta, open(meta_path, "w"))
        dist.barrier()
        ln2 = learner_for(LAYOUTS[load_layout], d, optim=optim)
        try:
            load_checkpoint(ln2, ckpt)
            results[name] = "no error"
        except CheckpointError as e:
            results[name] = str(e)
    want = {"old_format": "optimizer_format 1", "no_dist_optimizer": "needs the distributed optimizer"}
    return {"messages": results, "ok": all(want[k] in results[k] for k in want)}


VARIANT_CASES = {
    "ckrefuse": case_checkpoint_refused,
    "vparity": case_variant_parity,
    "ckexact": case_checkpoint_exact,
    "refused": case_refused,
}
VARIANT_CASES.update(__import__("tests.learner.fused_output_cases", fromlist=["CASES"]).CASES)


CASES = {
    "critic_ckpt": case_critic_checkpoint,
    "groups": case_groups,
    "frozen": case_frozen,
    "parity": case_parity,
    "roundtrip": case_roundtrip,
    "corrupt": case_corrupt,
    "logprobs": case_logprobs,
    "invariance": case_invariance,
    "checkpoint": case_checkpoint,
    "export": case_export,
    "objective": case_objective,
    "replay": case_replay,
    "critic": case_critic,
}
CASES.update(__import__("tests.learner.perturbation_cases", fromlist=["CASES"]).CASES)
CASES.update(__import__("tests.learner.self_teacher_cases", fromlist=["CASES"]).CASES)
CASES.update(__import__("tests.learner.gradient_cases", fromlist=["CASES"]).CASES)
CASES.update(__import__("tests.learner.teacher_cases", fromlist=["CASES"]).CASES)
CASES.update(__import__("tests.learner.probe_cases", fromlist=["CASES"]).CASES)
CASES.update(__import__("tests.learner.shared_head_cases", fromlist=["CASES"]).CASES)
CASES.update(__import__("tests.learner.correction_cases", fromlist=["CASES"]).CASES)


def run_case(spec: str, args) -> dict:
    """``name:dense|moe:layout[:micro | :load_layout]``, or ``name:variant:layout[:load_layout]`` for
    the ``VARIANT_CASES`` (``variant`` a key of ``VARIANTS``)."""
    parts = spec.split(":")
    if parts[0] in VARIANT_CASES:  # name:variant:layout[:load_layout]
        return VARIANT_CASES[parts[0]](args, parts[1], parts[2], *parts[3:])
    fn = CASES[parts[0]]
    moe = parts[1] == "moe"
    kw = {}
    if len(parts) > 3:
        kw = {"num_micro": int(parts[3])} if parts[3].isdigit() else {"load_layout": parts[3]}
    return fn(args, moe, parts[2], **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    init_distributed()
    for spec in args.cases.split(","):
        t0 = time.time()
        try:
            res = run_case(spec, args)
        except Exception as e:  # report and continue: one failing case must not hide the others
            res = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:],
            }
        res["seconds"] = round(time.time() - t0, 2)
        res["threads_after"] = len(os.listdir("/proc/self/task"))  # native threads of rank 0 (gloo's too)
        res["case"] = spec
        if dist.get_rank() == 0:
            print("CASE " + json.dumps(res), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
