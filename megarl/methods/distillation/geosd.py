"""GeoSD: geometric self-distillation (reconstructed; formulas: reference/distillation.py
``geosd_loss``, ``fisher_rao``, ``bhattacharyya``).

Per position, over the full vocabulary (vocab-parallel, never gathered):

    ℓ_t = H²(p_T, q_θ) + β · d_FR(q_θ, q_ck)²,   H² = 1 − BC,  d_FR = 2 arccos(BC)
    (d_FR² = 8(1 − BC), its expansion, for BC > 1 − 1e-7: arccos's gradient is infinite at 1)

- p_T: the self-teacher, the policy's own weights reading the prompt with a privileged context
  (the reference answer, a correct sibling, a majority-vote answer: the ``self_teacher_context``
  round input) before the response; input ``self_teacher_logits`` (the self-teacher's provider,
  megarl/methods/distillation/self_teacher.py: a forward of prompt + context + response, logits
  mapped back to the batch's tokens), which reaches the loss as ``LossContext.teacher_logits``.
  The Hellinger pull on a teacher token u is weighted by sqrt(q_θ(u)): it fades for tokens the
  student cannot support yet (forward KL's pull stays p_T(u)).
- q_ck: a lagged copy of the policy (input ``checkpoint_logits``): a forward-only learner that
  takes the policy's weights every ``inputs.checkpoint_logits.refresh_every`` RL steps (the
  initial policy until the first refresh); the Fisher-Rao proximal term keeps the student's
  predictions near it. After a resume the copy restarts from the resumed policy.

Registered as the regulariser ``geosd`` (``objective.regularisers: [{name: geosd, coef, beta}]``).
The natural-gradient update of the method is not built: the step is the run's optimizer (Adam);
docs/methods/geosd.md says which variants exist and what they would need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.objectives.regularisers import REGULARISERS
from megarl.ops.vocab_parallel import vocab_parallel_bhattacharyya, vocab_parallel_hellinger_sq
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

TEACHER, CHECKPOINT = "self_teacher_logits", "checkpoint_logits"  # inputs (logits [T, V/tp])
BC_MAX = 1.0 - 1e-7


def fisher_rao_sq(bc: torch.Tensor) -> torch.Tensor:
    """d_FR² = (2 arccos BC)² from the Bhattacharyya coefficient; 8(1 − BC), its expansion, for
    BC > 1 − 1e-7 (arccos's gradient is infinite at 1): 0 with zero gradient at the checkpoint."""
    far = (2.0 * torch.arccos(torch.clamp(bc, max=BC_MAX))) ** 2
    return torch.where(bc > BC_MAX, 8.0 * (1.0 - bc), far)


def geosd(logits, logp, old_logp, batch, ctx, beta: float = 0.1) -> torch.Tensor:
    """Per-token H²(p_T, q_θ) + β d_FR(q_θ, q_ck)² (the objective aggregates it, times ``coef``)."""
    if ctx.teacher_logits is None:
        raise ValueError(
            "regulariser geosd needs the self-teacher's logits (input self_teacher_logits: "
            "LossContext.teacher_logits [T, V/tp])"
        )
    if CHECKPOINT not in batch.token_extras:
        raise ValueError(f"regulariser geosd needs token_extras[{CHECKPOINT!r}] (input {CHECKPOINT})")
    teacher = ctx.teacher_logits.to(logits.device).detach()
    ck = batch.token_extras[CHECKPOINT].to(logits.device).detach()
    h2 = vocab_parallel_hellinger_sq(teacher, logits, ctx.tp_group, ctx.chunk_tokens)
    bc = vocab_parallel_bhattacharyya(logits, ck, ctx.tp_group, ctx.chunk_tokens)
    return (h2 + beta * fisher_rao_sq(bc)).to(logp.dtype)


@dataclass
class CheckpointKnobs(Knobs):
    """refresh_every: RL steps between two copies of the policy's weights into the lagged copy."""

    refresh_every: int = 10

    def check(self) -> None:
        """At least 1."""
        if self.refresh_every < 1:
            raise ValueError(f"refresh_every={self.refresh_every} must be >= 1")


def copy_weights(dst: Any, src: Any) -> None:
    """The weights of learner ``src`` into learner ``dst`` (same architecture and layout)."""
    pairs = list(zip(dst.model.parameters(), src.model.parameters(), strict=True))
    for d, s in pairs:
        if d.shape != s.shape:
            raise ValueError(
                f"checkpoint_logits: parameter shapes differ ({tuple(d.shape)} vs {tuple(s.shape)})"
            )
    with torch.no_grad():
        for d, s in pairs:
            d.copy_(s)


class CheckpointPass:
    """The ``checkpoint_logits`` learner pass: a lagged, forward-only copy of the policy, refreshed
    from the policy at RL steps 1, K + 1, 2K + 1, ... (K = ``refresh_every``)."""

    def __init__(self, copy: Any, policy: Any, refresh_every: int):
        self.copy, self.policy, self.refresh_every = copy, policy, refresh_every
        self.calls = 0

    def fill(self, batch: PackedBatch, micro_batches: int) -> dict[str, float]:
        """In place (collective); reports the steps since the last refresh."""
        if self.calls % self.refresh_every == 0:
            copy_weights(self.copy, self.policy)
        age = self.calls % self.refresh_every
        self.calls += 1
        logits = self.copy.compute_logits(batch, micro_batches)
        if logits is not None:
            batch.token_extras[CHECKPOINT] = logits
        return {"geosd/checkpoint_age": float(age)}


def _checkpoint(ctx: Any, names: frozenset) -> CheckpointPass:
    copy = ctx.make_learner(ctx.hf_config, ctx.init_dir, trainable=False)
    return CheckpointPass(copy, ctx.policy, ctx.knobs.refresh_every)


register_provider(
    InputProvider(
        (CHECKPOINT,),
        "learner",
        _checkpoint,
        knobs=CheckpointKnobs,
        summary="logits of a lagged forward-only copy of the policy (refreshed every refresh_every steps)",
    )
)
REGULARISERS.add("geosd", geosd, PartInfo(batch_inputs=(TEACHER, CHECKPOINT)))

SPEC = MethodSpec(
    name="geosd",
    summary="GeoSD: Hellinger self-distillation from a privileged-context self-teacher + Fisher-Rao "
    "proximal term to a lagged checkpoint",
    provenance="reconstructed",
    config={
        "objective": {
            "policy_loss": "none",
            "aggregation": "token-mean",
            "regularisers": [{"name": "geosd", "coef": 1.0, "beta": 0.1}],
        },
        "inputs": {
            "self_teacher_context": {"source": "answer", "when": "all"},
            "checkpoint_logits": {"refresh_every": 10},
        },
    },
)
