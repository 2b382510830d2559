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

``geosd_natural`` (same knobs plus ``damping`` λ) is the output-space natural-gradient step of the
method (its option (b), reconstructed): the same loss value, but the logits gradient of every
token is the damped natural gradient in the Fisher metric of the categorical,

    ĝ_t = (F_t + λI)^{-1} g_t,   F_t = diag(q_t) − q_t q_tᵀ,   g_t = ∂ℓ_t/∂z_t

(F_t is the Fisher information of softmax(z_t) in logit coordinates, the pull-back of 4× the
Euclidean metric of sqrt(q)-space, where H and d_FR are the chordal and geodesic distances: ĝ is
the sqrt(q)-space step mapped back through the logits). g_t is analytic (the Hellinger and
Fisher-Rao logit gradients), ĝ_t from Sherman-Morrison with two vocab-parallel sums per token, so
nothing is gathered over TP; the network's parameters then get ĝ backpropagated (a Gauss-Newton
step through the logits; the run's optimizer still applies it). A parameter-space K-FAC or Shampoo
preconditioner (option (a)) is not built: docs/methods/geosd.md says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.objectives.regularisers import REGULARISERS
from megarl.ops import comm
from megarl.ops.vocab_parallel import (
    vocab_parallel_bhattacharyya,
    vocab_parallel_hellinger_sq,
    vocab_parallel_logsumexp,
)
from megarl.plugin.inputs import InputProvider, register_provider
from megarl.plugin.knobs import Knobs
from megarl.plugin.spec import MethodSpec
from megarl.registry import PartInfo

TEACHER, CHECKPOINT = "self_teacher_logits", "checkpoint_logits"  # inputs (logits [T, V/tp])
READ = "self_teacher_on"  # extras [S]: 1 where the self-teacher read the sequence with its context
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
    read = batch.extras.get(READ)
    if read is not None and bool((read < 0.5).any()):
        # an unread sequence's teacher logits are zeros (a uniform teacher) and GeoSD pulls every
        # token toward its teacher: refuse rather than distil toward uniform
        raise ValueError(
            f"regulariser geosd: the self-teacher read {int((read >= 0.5).sum())} of {read.numel()} "
            "sequences; GeoSD distils every sequence, so it needs inputs.self_teacher_context.when: all"
        )
    teacher = ctx.teacher_logits.to(logits.device).detach()
    ck = batch.token_extras[CHECKPOINT].to(logits.device).detach()
    h2 = vocab_parallel_hellinger_sq(teacher, logits, ctx.tp_group, ctx.chunk_tokens)
    bc = vocab_parallel_bhattacharyya(logits, ck, ctx.tp_group, ctx.chunk_tokens)
    return (h2 + beta * fisher_rao_sq(bc)).to(logp.dtype)


def fisher_rao_sq_slope(bc: torch.Tensor) -> torch.Tensor:
    """d(d_FR²)/dBC of ``fisher_rao_sq``: −8 arccos(BC)/sqrt(1 − BC²), and −8 on its expansion."""
    c = torch.clamp(bc, max=BC_MAX)
    far = -8.0 * torch.arccos(c) / torch.sqrt(1.0 - c * c)
    return torch.where(bc > BC_MAX, torch.full_like(bc, -8.0), far)


def _probs(z: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """softmax of vocab-parallel logits on this rank's shard [T, V/tp] (global normaliser)."""
    return torch.exp(z - vocab_parallel_logsumexp(z, tp_group).unsqueeze(-1))


@torch.no_grad()
def natural_logit_grad(
    logits: torch.Tensor,
    teacher: torch.Tensor,
    ck: torch.Tensor,
    beta: float,
    damping: float,
    tp_group: Any = None,
) -> torch.Tensor:
    """ĝ = (diag(q) − q qᵀ + λI)^{-1} ∂ℓ/∂z per token on this rank's vocab shard [T, V/tp], ℓ the
    GeoSD loss (see the module docstring); two all-reduces for the BCs, one for the solve."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    z, zt, zc = logits.detach().to(acc), teacher.detach().to(acc), ck.detach().to(acc)
    q, p, r = _probs(z, tp_group), _probs(zt, tp_group), _probs(zc, tp_group)
    sp, sr = torch.sqrt(p * q), torch.sqrt(q * r)
    bcs = comm.all_reduce(torch.stack([sp.sum(-1), sr.sum(-1)]), "sum", tp_group)
    bc_t, bc_c = bcs[0].unsqueeze(-1), bcs[1].unsqueeze(-1)
    g = -0.5 * (sp - q * bc_t) + beta * fisher_rao_sq_slope(bcs[1]).unsqueeze(-1) * 0.5 * (sr - q * bc_c)
    d = q + damping
    ab = comm.all_reduce(torch.stack([(q * g / d).sum(-1), (q * q / d).sum(-1)]), "sum", tp_group)
    return g / d + (q / d) * (ab[0] / (1.0 - ab[1])).unsqueeze(-1)


def geosd_natural(
    logits, logp, old_logp, batch, ctx, beta: float = 0.1, damping: float = 1e-3
) -> torch.Tensor:
    """Per-token GeoSD loss whose logits gradient is the damped natural gradient ĝ (the value is
    ``geosd``'s; the objective aggregates it, times ``coef``)."""
    if damping <= 0:
        raise ValueError(f"regulariser geosd_natural: damping={damping!r} must be > 0")
    value = geosd(logits.detach(), logp, old_logp, batch, ctx, beta=beta).detach()
    teacher = ctx.teacher_logits.to(logits.device)
    ck = batch.token_extras[CHECKPOINT].to(logits.device)
    nat = natural_logit_grad(logits, teacher, ck, beta, damping, ctx.tp_group).to(logits.dtype)
    part = (logits * nat).sum(-1)  # this shard's part: its gradient w.r.t. the shard's logits is ĝ
    return value + (part - part.detach()).to(logp.dtype)


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
REGULARISERS.add("geosd_natural", geosd_natural, PartInfo(batch_inputs=(TEACHER, CHECKPOINT)))

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
