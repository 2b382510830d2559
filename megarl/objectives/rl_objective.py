"""The composed RL objective: policy loss x correction + KL + entropy bonus + distillation.

    logp, H = vocab-parallel logprobs/entropy of logits [T, V/tp]
    L = agg(pg · c) + β_kl agg(kl) - β_H agg(H) + β_d agg(distill)
Equal, by the property tests, to reference/loss.py:rl_loss on the padded batch.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.objectives import rollout_correction
from megarl.objectives.aggregation import aggregate
from megarl.objectives.api import LossContext, LossOutput
from megarl.objectives.distillation import DISTILLATION
from megarl.objectives.kl import KL_ESTIMATORS
from megarl.objectives.objective_config import ObjectiveConfig
from megarl.objectives.policy_losses import POLICY_LOSSES
from megarl.objectives.regularisers import REGULARISERS
from megarl.ops.vocab_parallel import vocab_parallel_logprobs_entropy

CLIP_KNOBS = ("clip_low", "clip_high", "dual_clip")
__all__ = ["CLIP_KNOBS", "ObjectiveConfig", "RLObjective", "build_objective", "resolved_clip"]


class RLObjective:
    """``objective(logits [T, V/tp], batch, ctx) -> LossOutput``; see megarl/objectives/api.py."""

    current_old_logprobs = True  # honours LossContext.old_is_current

    def __init__(self, cfg: ObjectiveConfig):
        self.cfg = cfg.validate()
        self.clip = resolved_clip(cfg)
        # state of stateful parts (e.g. EPPO's per-task entropy EMA), keyed by config path
        self.state: dict[str, Any] = {}
        for key, info, knobs in self._parts():
            if info.make_state is not None:
                self.state[key] = info.make_state(**knobs)

    def _parts(self):
        """(config path, PartInfo, knobs) of the policy loss and every regulariser."""
        yield "policy_loss", POLICY_LOSSES.info(self.cfg.policy_loss), dict(self.cfg.policy_loss_args)
        for i, reg in enumerate(self.cfg.regularisers):
            knobs = {k: v for k, v in reg.items() if k not in ("name", "coef")}
            yield f"regularisers.{i}", REGULARISERS.info(reg["name"]), knobs

    def accepts_token_stats(self) -> bool:
        """True when no configured part reads the full logits (the distillation term and every
        regulariser declare ``reads_logits=False``): the learner may then fuse its output layer and
        pass ``LossContext.token_stats`` instead of logits."""
        parts = [DISTILLATION.info(self.cfg.distill)]
        parts += [REGULARISERS.info(reg["name"]) for reg in self.cfg.regularisers]
        return not any(p.reads_logits for p in parts)

    @property
    def narrows_loss_mask(self) -> bool:
        """True when ``prepare`` takes tokens out of the loss mask (rejected tokens leave the
        denominator): the caller's normalisers must then be recounted (api.step_normalisers)."""
        return rollout_correction.global_stage(self.cfg) and self.cfg.correction_denominator == "drop"

    def prepare(self, batch: PackedBatch, dp_group: Any = None) -> PackedBatch:
        """Call once per optimizer step on this DP rank's whole batch, before splitting it into
        micro-batches. Parts that need statistics of the global batch (``PartInfo.prepare``:
        GAPO's mean |A|, CoKL's group weights, EPPO's task entropies) compute them here, reduced
        over ``dp_group``, store them per sequence in ``batch.extras`` and update their state.
        The rollout correction's global stage (batch-normalised weights, rejected tokens out of
        the loss mask) runs first, so the parts see the final mask. Returns the batch to split."""
        batch = rollout_correction.prepare(self.cfg, batch, dp_group)
        for key, info, knobs in self._parts():
            if info.prepare is not None:
                batch = info.prepare(batch, dp_group, self.state.get(key), **knobs)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """State of the stateful parts, to save in a checkpoint ({} when there are none)."""
        return {k: v.state_dict() for k, v in self.state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; a missing or unexpected part is an error naming it."""
        if set(state) != set(self.state):
            raise ValueError(
                f"objective state has parts {sorted(state)}, this objective {sorted(self.state)}"
            )
        for k, v in state.items():
            self.state[k].load_state_dict(v)

    def __call__(self, logits: torch.Tensor, batch: PackedBatch, ctx: LossContext) -> LossOutput:
        cfg, norm = self.cfg, ctx.normalisers
        want_entropy = True  # entropy is a metric in every run; it costs one extra row in the reduction
        if ctx.token_stats is not None:  # the learner's fused output layer computed them (logits: None)
            logp, ent = ctx.token_stats
        else:
            logp, ent = vocab_parallel_logprobs_entropy(
                logits, batch.tokens, ctx.tp_group, ctx.chunk_tokens, with_entropy=want_entropy
            )
        mask, cu = batch.loss_mask.to(logp.dtype), batch.cu_seqlens
        old = None if ctx.old_is_current else _first_present(batch.old_logprobs, batch.rollout_logprobs)
        old = logp.detach() if old is None else old.to(logp.dtype)
        adv = batch.advantages
        if adv is None:
            if cfg.policy_loss != "none":
                raise ValueError(f"policy_loss={cfg.policy_loss!r} needs the batch field 'advantages'")
            adv = torch.zeros_like(logp)
        adv = adv.to(logp.dtype)

        def agg(x: torch.Tensor) -> torch.Tensor:
            return aggregate(x, mask, cu, cfg.aggregation, norm)

        extra = _policy_extra(cfg, self.clip, batch, ctx, ent)
        pg = POLICY_LOSSES.get(cfg.policy_loss)(logp, old, adv, mask, cu, **extra)
        metrics: dict[str, torch.Tensor] = {}
        token_metrics = POLICY_LOSSES.info(cfg.policy_loss).token_metrics
        if token_metrics is not None:  # per-token diagnostics of the loss, token-mean over the global batch
            for k, v in token_metrics(logp.detach(), old, adv, mask, cu, **extra).items():
                metrics[f"{cfg.policy_loss}/{k}"] = _token_mean(v, mask, norm)
        if rollout_correction.active(cfg):
            if ctx.old_is_current:
                raise ValueError(f"correction={cfg.correction!r} needs recomputed 'old_logprobs'")
            if batch.rollout_logprobs is None or batch.old_logprobs is None:
                raise ValueError(f"correction={cfg.correction!r} needs 'old_logprobs' and 'rollout_logprobs'")
            c = batch.token_extras.get(rollout_correction.MULTIPLIER)
            if c is None:
                if rollout_correction.global_stage(cfg):
                    raise ValueError(
                        "correction_normalise / correction_denominator: drop need "
                        "objective.prepare on the batch"
                    )
                old_c, roll_c = batch.old_logprobs.to(logp.dtype), batch.rollout_logprobs.to(logp.dtype)
                c = rollout_correction.multiplier_and_keep(cfg, old_c, roll_c, mask, cu)[0]
            c = c.to(logp.device, logp.dtype)
            pg = pg * c
            metrics["correction_zeroed_frac"] = _token_mean((c == 0).to(logp.dtype), mask, norm)
            dropped = batch.extras.get(rollout_correction.DROPPED)
            if dropped is not None:  # global fraction of loss tokens prepare took out of the mask
                metrics["correction_dropped_frac"] = dropped.sum().to(logp.device, logp.dtype)
        pg_loss = agg(pg)
        loss = pg_loss
        metrics["pg_loss"] = pg_loss.detach()
        if cfg.kl_coef:
            if batch.ref_logprobs is None:
                raise ValueError("kl_coef > 0 needs the batch field 'ref_logprobs'")
            kl = agg(KL_ESTIMATORS.get(cfg.kl_estimator)(logp, batch.ref_logprobs.to(logp.dtype)))
            loss = loss + cfg.kl_coef * kl
            metrics["kl"] = kl.detach()
        ent_agg = agg(ent)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * ent_agg
        if cfg.distill != "none":
            d = agg(DISTILLATION.get(cfg.distill)(logits, logp, old, batch, ctx))
            loss = loss + cfg.distill_coef * d
            metrics["distill"] = d.detach()
        for reg in cfg.regularisers:
            knobs = {k: v for k, v in reg.items() if k not in ("name", "coef")}
            term = REGULARISERS.get(reg["name"])(logits, logp, old, batch, ctx, **knobs)
            # a group-level term (CoKL) returns its globally normalised scalar contribution itself
            term = term if REGULARISERS.info(reg["name"]).aggregates_itself else agg(term)
            loss = loss + reg["coef"] * term
            metrics[f"reg/{reg['name']}"] = term.detach()
        ratio = torch.exp(logp.detach() - old)
        lo, hi = self.clip["clip_low"], self.clip["clip_high"]  # None: a loss that clips through another
        clipped = (ratio < 1 - (0.2 if lo is None else lo)) | (ratio > 1 + (0.28 if hi is None else hi))
        metrics["entropy"] = _token_mean(ent.detach(), mask, norm)
        metrics["clip_frac"] = _token_mean(clipped.to(logp.dtype), mask, norm)
        metrics["ratio_mean"] = _token_mean(ratio, mask, norm)
        if batch.rollout_logprobs is not None:
            gap = (logp.detach() - batch.rollout_logprobs.to(logp.dtype)).abs()
            metrics["train_rollout_logprob_gap"] = _token_mean(gap, mask, norm)
        if ctx.old_is_current and batch.ref_logprobs is not None:  # the old-vs-reference KL, here
            kl_old = logp.detach() - batch.ref_logprobs.to(logp.dtype)
            metrics["kl_old_ref"] = _token_mean(kl_old, mask, norm)
        metrics["loss"] = loss.detach()
        return LossOutput(loss=loss, metrics=metrics)


def resolved_clip(cfg: ObjectiveConfig) -> dict[str, Any]:
    """``clip_low``/``clip_high``/``dual_clip`` as the policy loss receives them: the configured value,
    or the loss's own default where the config leaves it unset (GSPO's 3e-4/4e-4, not PPO's)."""
    params = inspect.signature(POLICY_LOSSES.get(cfg.policy_loss)).parameters
    out: dict[str, Any] = {}
    for key in CLIP_KNOBS:
        v = getattr(cfg, key)
        if v is None and key in params and params[key].default is not inspect.Parameter.empty:
            v = params[key].default
        out[key] = v
    return out


def _policy_extra(
    cfg: ObjectiveConfig,
    clip: dict[str, Any],
    batch: PackedBatch,
    ctx: LossContext,
    ent: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Keyword arguments of the policy loss: the resolved clip range, the configured knobs, and
    what its ``PartInfo`` declares (``batch=``/``ctx=`` with ``needs_context``, the current
    policy's full-vocab entropy as ``entropy=`` with ``needs_entropy``)."""
    extra = dict(clip)
    extra.update(cfg.policy_loss_args)
    info = POLICY_LOSSES.info(cfg.policy_loss)
    if info.needs_context:
        extra.update(batch=batch, ctx=ctx)
    if info.needs_entropy:
        extra.update(entropy=ent)
    return extra


def _first_present(*xs):
    for x in xs:
        if x is not None:
            return x
    return None


def _token_mean(x: torch.Tensor, mask: torch.Tensor, norm) -> torch.Tensor:
    return ((x * mask).sum() / max(norm.num_tokens, 1.0)).detach()


def objective_heads(cfg: ObjectiveConfig) -> tuple[str, ...]:
    """The learner output heads the configured parts read (``PartInfo.heads``), in config order."""
    heads: list[str] = list(POLICY_LOSSES.info(cfg.policy_loss).heads)
    for reg in cfg.regularisers:
        heads += REGULARISERS.info(reg["name"]).heads
    return tuple(dict.fromkeys(heads))


def build_objective(cfg: ObjectiveConfig | dict) -> RLObjective:
    """An RLObjective from a config object or a plain dict (unknown keys raise, naming them)."""
    if isinstance(cfg, dict):
        known = set(ObjectiveConfig.__dataclass_fields__)
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"unknown objective key(s) {unknown}; allowed: {', '.join(sorted(known))}")
        cfg = ObjectiveConfig(**cfg)
    return RLObjective(cfg)
