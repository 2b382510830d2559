"""The rollout correction's dropping denominator inside the Megatron learner (a case for
tests/learner/dist_cases.py, asserted by test_learner_dist.py).

``correction:<model>:<layout>[:micro]``: ``correction_denominator: drop`` takes the rejected tokens
out of the loss mask in ``RLObjective.prepare`` on each DP rank's shard, and ``train_step`` recounts
the normalisers of the narrowed mask over the DP group (``narrows_loss_mask``,
``megarl.objectives.api.step_normalisers``). The trainer's normalisers, counted before prepare on
the full mask, are passed in as the trainer passes them. The global batch's rejections are uneven
over the shards (one shard's sequences have a much larger train/rollout gap), so a recount that
is skipped, or not summed over DP, changes the loss. Per configuration (token-mean; and
seq-mean-token-mean with truncated IS, a chain with a sequence-level criterion, batch
normalisation, KL and entropy terms), from the same initial weights: the step's loss, its
``correction_dropped_frac`` and every parameter's gradient (HF names, reduced over DP, read by an
optimizer hook before the step) equal reference/loss.py ``rl_loss`` on the gathered batch, its
gradient taken through the transformers model of the same weights.
"""

from __future__ import annotations

import itertools

import torch

# fp32 forward of Megatron vs transformers; the loss itself in float64 on both sides
LOSS_TOL = 1e-5
GRAD_TOL = 1e-4  # of the largest reference gradient entry

CONFIGS = {
    "token-mean": dict(
        policy_loss="ppo",
        clip_low=0.2,
        clip_high=0.28,
        aggregation="token-mean",
        correction="token_k2",
        correction_low=0.0,
        correction_high=0.005,
        correction_denominator="drop",
    ),
    "seq-mean-token-mean": dict(
        policy_loss="ppo",
        clip_low=0.2,
        clip_high=0.28,
        aggregation="seq-mean-token-mean",
        kl_coef=0.05,
        kl_estimator="k3",
        entropy_coef=0.01,
        correction="tis",
        correction_high=2.0,
        correction_chain=[{"name": "token_k3", "high": 0.01}, {"name": "seq_max_k2", "high": 0.15}],
        correction_normalise=True,
        correction_denominator="drop",
    ),
}


class GradCapture:
    """Optimizer hook: the DP-reduced gradients of the step, as HF-named tensors (every rank)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def before_optimizer_step(self, learner) -> None:
        """Read every ``main_grad`` through the weight export (HF names), weights left unchanged."""
        from megarl.convert.hf_megatron import iter_hf_tensors

        saved = {}
        for name, p in learner.model.named_parameters():
            saved[name] = p.data.clone()
            p.data.copy_(p.main_grad.detach())
        self.grads = {k: t.clone() for k, t in iter_hf_tensors(learner.model, learner.groups)}
        for name, p in learner.model.named_parameters():
            p.data.copy_(saved[name])

    def after_optimizer_step(self, learner, ok: bool) -> None:
        """Nothing after the step."""


def _padded_logits(hf, batch) -> torch.Tensor:
    """Aligned logits of ``hf`` [B, L, V] in float64 with their graph (row t predicts token t)."""
    from megarl.batch import unpack

    rows = []
    for a, e in itertools.pairwise(batch.cu_seqlens.tolist()):
        lg = hf(batch.tokens[None, a:e]).logits[0]
        rows.append(torch.cat([lg.new_zeros(1, lg.shape[-1]), lg[:-1]]))
    full = torch.cat(rows).double()
    am = unpack(batch).attention_mask
    out = full.new_zeros(*am.shape, full.shape[-1])
    out[am] = full
    return out


def _reference(hf, batch, cfg: dict) -> tuple[float, float, dict[str, torch.Tensor]]:
    """(loss, dropped fraction, gradients by HF name) of reference/loss.py on the whole batch."""
    from megarl.batch import unpack
    from reference.corrections import rollout_correction
    from reference.loss import rl_loss

    pad = unpack(batch)
    pt = pad.per_token
    mask, old, roll = pad.loss_mask.double(), pt["old_logprobs"].double(), pt["rollout_logprobs"].double()
    hf.zero_grad(set_to_none=True)
    loss = rl_loss(
        _padded_logits(hf, batch),
        pad.tokens,
        mask,
        pt["advantages"].double(),
        old,
        policy_loss=cfg["policy_loss"],
        clip_low=cfg["clip_low"],
        clip_high=cfg["clip_high"],
        aggregation_mode=cfg["aggregation"],
        kl_coef=cfg.get("kl_coef", 0.0),
        kl_estimator=cfg.get("kl_estimator", "k3"),
        ref_logp=pt["ref_logprobs"].double(),
        entropy_coef=cfg.get("entropy_coef", 0.0),
        correction=cfg["correction"],
        rollout_logp=roll,
        corr_low=cfg.get("correction_low", 0.5),
        corr_high=cfg["correction_high"],
        correction_chain=cfg.get("correction_chain", ()),
        correction_normalise=cfg.get("correction_normalise", False),
        correction_denominator=cfg["correction_denominator"],
    )
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters() if p.grad is not None}
    _, kept = rollout_correction(
        cfg["correction"],
        old,
        roll,
        mask,
        cfg.get("correction_low", 0.5),
        cfg["correction_high"],
        chain=cfg.get("correction_chain", ()),
        drop=True,
    )
    return float(loss), float((mask - kept).sum() / mask.sum()), grads


def _batch(ln):
    """The global batch (same on every rank): old logprobs near the policy's, rollout logprobs
    with a per-sequence gap, large on the first half of the sequences (the first DP shard)."""
    from tests.learner.dist_cases import make_batch

    lens = (7, 13, 5, 9, 6, 8, 10, 4)
    batch = make_batch(53, lens=lens)
    lp, _ = ln.compute_logprobs(batch)
    g = torch.Generator().manual_seed(9)
    m = batch.loss_mask
    gap = torch.repeat_interleave(torch.tensor([0.3] * 4 + [0.04] * 4), torch.tensor(lens))
    batch.old_logprobs = torch.clamp(lp + 0.3 * torch.randn(lp.shape, generator=g), max=0.0) * m
    batch.rollout_logprobs = (batch.old_logprobs + gap * torch.randn(lp.shape, generator=g)) * m
    batch.ref_logprobs = torch.clamp(lp + 0.2 * torch.randn(lp.shape, generator=g), max=0.0) * m
    return batch


def case_correction(args, moe: bool, layout_name: str, num_micro: int = 2) -> dict:
    """See the module docstring."""
    from megarl.learner.learner import OptimConfig
    from megarl.objectives.api import GlobalNormalisers
    from megarl.objectives.rl_objective import ObjectiveConfig, RLObjective
    from tests.learner.dist_cases import LAYOUTS, dp_shard, learner_for, make_hf_model, max_over_world

    hf, d = make_hf_model(moe, args.workdir)
    # the plain optimizer: every rank holds the whole DP-reduced gradient before the step
    optim = OptimConfig(lr=1e-3, clip_grad=1.0, adam_eps=1e-6, use_distributed_optimizer=False)
    ln = learner_for(LAYOUTS[layout_name], d, optim)
    capture = GradCapture()
    ln.add_optimizer_hook(capture)
    batch = _batch(ln)
    g = ln.groups
    dp_group = g.dp if g.dp_size > 1 else None
    local = dp_shard(batch, ln)
    out: dict = {"dp_size": g.dp_size}
    ok = g.dp_size > 1
    for name, knobs in CONFIGS.items():
        ref_loss, ref_dropped, ref_g = _reference(hf, batch, knobs)
        ln.load_hf(d)  # every configuration starts from the initial weights
        objective = RLObjective(ObjectiveConfig(**knobs))
        # this shard's share of rejected tokens: the shards must differ for the DP recount to matter
        shard_kept = objective.prepare(local).loss_mask.sum() / local.loss_mask.sum()
        spread = max_over_world(float(shard_kept)) + max_over_world(-float(shard_kept))
        norms = GlobalNormalisers.from_batch(local, dp_group)  # on the full mask, as the trainer counts
        metrics = ln.train_step(local, objective, num_micro_batches=num_micro, normalisers=norms)
        common = sorted(set(ref_g) & set(capture.grads))
        scale = max(float(ref_g[k].abs().max()) for k in common)
        d_grad = max_over_world(max(float((capture.grads[k] - ref_g[k]).abs().max()) for k in common) / scale)
        ref_norm = float(torch.stack([ref_g[k].double().pow(2).sum() for k in common]).sum().sqrt())
        row = {
            "loss": metrics["loss"],
            "reference_loss": ref_loss,
            "d_loss": abs(metrics["loss"] - ref_loss),
            "dropped_frac": metrics.get("correction_dropped_frac"),
            "reference_dropped_frac": ref_dropped,
            "shard_kept_spread": spread,
            "d_grad_rel": d_grad,
            "grad_norm": metrics["grad_norm"],
            "reference_grad_norm": ref_norm,
            "grads_compared": len(common),
        }
        out[name] = row
        ok = (
            ok
            and row["d_loss"] <= LOSS_TOL * max(1.0, abs(ref_loss))
            and row["dropped_frac"] is not None
            and abs(row["dropped_frac"] - ref_dropped) <= 1e-6  # a float32 metric
            and 0.1 <= ref_dropped <= 0.9
            and spread >= 0.2
            and d_grad <= GRAD_TOL
            and abs(metrics["grad_norm"] - ref_norm) <= GRAD_TOL * max(1.0, ref_norm)
            and len(common) == len(ref_g)
        )
    out["ok"] = ok
    return out


CASES = {"correction": case_correction}
