"""The core batch-input providers (registered in megarl/plugin/inputs.py's ``INPUT_PROVIDERS``).

- ``old_logprobs``, ``entropies`` [T]: one forward pass of the policy before the update (the
  behaviour policy's logprobs when ``schedule.old_logprobs: recompute``; its full-vocab entropy);
- ``ref_logprobs`` [T]: a frozen reference learner holding the initial policy (KL terms);
- ``teacher_logprobs`` [T]: a forward-only teacher learner (``teacher.hf_dir``; on-policy
  distillation), its own architecture, the policy's vocabulary; or, with ``teacher.source:
  engine``, a rollout engine serving the teacher (megarl/plugin/engine_teacher.py);
- ``teacher_logits`` / ``teacher_topk``: the same teacher's full logits and top-K, in
  ``token_extras`` (megarl/plugin/teacher_pass.py);
- ``reward_dims``: ``rewards`` [B, K] with ``reward_names`` (the named reward dimensions).
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.plugin.inputs import InputProvider, RolloutInfo, register_provider
from megarl.plugin.teacher_config import teacher_config
from megarl.plugin.teacher_pass import MegatronTeacherPass, TeacherKnobs


class PolicyPass:
    """Fills ``old_logprobs`` and/or ``entropies`` with one forward pass of the policy learner."""

    def __init__(self, policy: Any, names: frozenset):
        self.policy, self.names = policy, names

    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """In place (collective); returns the behaviour policy's mean entropy when computed."""
        lp, ent = self.policy.compute_logprobs(batch, micro_batches, with_entropy="entropies" in self.names)
        if "old_logprobs" in self.names:
            batch.old_logprobs = lp
        if "entropies" not in self.names:
            return {}
        batch.entropies = ent
        m = batch.loss_mask.bool()
        return {"rollout/entropy_old": float(ent[m].mean()) if bool(m.any()) else 0.0}


class FrozenPass:
    """Fills one logprob field (``ref_logprobs`` or ``teacher_logprobs``) with a forward-only learner."""

    def __init__(self, learner: Any, field: str):
        self.learner, self.field = learner, field

    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """In place (collective)."""
        lp, _ = self.learner.compute_logprobs(batch, micro_batches)
        setattr(batch, self.field, lp)
        return {}


def teacher_hf_config(cfg: Any, policy_hf: dict) -> dict:
    """The teacher's HF config (``teacher.hf_dir``), checked to share the policy's vocabulary; with
    the char tokenizer the special token ids are the tokenizer's, as for the policy."""
    from megarl.learner.model import load_hf_config

    teacher = teacher_config(cfg)
    if not teacher.hf_dir:
        o = cfg.objective  # the parts that may read a teacher input
        parts = [
            f"advantage.estimator={cfg.advantage.estimator!r}",
            f"objective.policy_loss={o.policy_loss!r}",
        ]
        parts += [f"objective.distill={o.distill!r}"] + [f"regulariser {r['name']!r}" for r in o.regularisers]
        raise ValueError(
            f"the teacher input of this run ({', '.join(parts)}) needs teacher.hf_dir (the teacher's "
            "HF checkpoint, sharing the policy's vocabulary)"
        )
    hf = dict(load_hf_config(teacher.hf_dir))
    if int(hf.get("vocab_size", -1)) != int(policy_hf["vocab_size"]):
        raise ValueError(
            f"teacher.hf_dir={teacher.hf_dir}: vocab_size {hf.get('vocab_size')} differs from the "
            f"policy's {policy_hf['vocab_size']} (distillation compares logprobs of the same tokens)"
        )
    for k in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if k in policy_hf:
            hf[k] = policy_hf[k]
    return hf


def _reference(ctx: Any, names: frozenset) -> FrozenPass:
    return FrozenPass(ctx.make_learner(ctx.hf_config, ctx.init_dir, trainable=False), "ref_logprobs")


def _teacher(ctx: Any, names: frozenset) -> Any:
    top_k = ctx.knobs.top_k if ctx.knobs is not None else TeacherKnobs().top_k
    if teacher_config(ctx.cfg).source == "engine":  # served by an engine (plugin/engine_teacher.py)
        from megarl.plugin.engine_teacher import build_engine_teacher

        return build_engine_teacher(ctx, names, top_k)
    hf = teacher_hf_config(ctx.cfg, ctx.hf_config)
    learner = ctx.make_learner(hf, teacher_config(ctx.cfg).hf_dir, trainable=False)
    return MegatronTeacherPass(learner, names, top_k, getattr(ctx.knobs, "rows", ""))


class RewardDims:
    """Fills ``rewards`` [B, K] and ``reward_names`` from the rollouts' named reward dimensions."""

    def fill(self, batch: PackedBatch, info: RolloutInfo) -> dict[str, float]:
        """In place."""
        names = list(info.reward_dims)
        batch.reward_names = names
        batch.rewards = torch.stack(
            [torch.as_tensor(info.reward_dims[n], dtype=torch.float32) for n in names], 1
        )
        return {}


register_provider(
    InputProvider(
        ("old_logprobs", "entropies"),
        "learner",
        lambda ctx, names: PolicyPass(ctx.policy, names),
        summary="the policy's logprobs and full-vocab entropy before the update",
    )
)
register_provider(
    InputProvider(
        ("ref_logprobs",),
        "learner",
        _reference,
        summary="a frozen reference learner holding the initial policy",
    )
)
register_provider(
    InputProvider(
        ("teacher_logprobs", "teacher_logits", "teacher_topk"),
        "learner",
        _teacher,
        knobs=TeacherKnobs,
        summary="a forward-only teacher learner (teacher.hf_dir) or a teacher engine (teacher.source): "
        "logprobs of the tokens, full logits (token_extras), top-K ids and logprobs",
    )
)
register_provider(
    InputProvider(
        ("reward_dims",), "batch", lambda ctx, names: RewardDims(), summary="rewards [B, K] with reward_names"
    )
)
