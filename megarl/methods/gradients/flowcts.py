"""FlowCTS: flow continuous trajectory supervision, on-policy distillation for flow models
(reconstructed), on a tiny flow model: the plain-PyTorch velocity MLP of
megarl/methods/gradients/flow_model.py (``model: mlp``) or the DiT on megatron-core of
megarl/learner/flow_dit.py (``model: megatron``: TP-sharded, MoE with EP, megatron's optimizer).

FlowCTS time τ runs from 0 (noise) to 1 (data); a field is dx/dτ, so the velocity model gives
``f(x, τ) = −v(x, 1 − τ)``. From a student-visited state x at τ = t_k (the student's own Euler
ODE path from noise, stopped at a random grid step), the student and the reference each follow
their own Euler path for N steps of h = (1 − t_k)/N and their fields are matched with the weight
of the trajectory bound:

    L_N = Σ_{j<N} w(u_j) ‖f_S(x^S_j, u_j) − f_R(x̂_j, u_j)‖² h,   w(u) = ½[(1 − t_k)² − (u − t_k)²]

(x̂_j: the reference's own path, or the student's point with ``own_paths: false``). By
Cauchy-Schwarz, Σ_j h ‖x^S_j − x^R_j‖² ≤ L_N on Euler paths. N = 1 is velocity matching at the
visited state with weight w(t_k). ``through_path: false`` stops the gradient at the student's path
points (cheap); true back-propagates through its Euler steps. ``objective: kl_opd`` is the
baseline: along the student's path, the KL between the two auxiliary SDE transitions of each step,
``h ‖f_S − f_R‖² / (2 σ²)``, σ² = a² (1 − u)/u (Flow-GRPO's σ_t at t = 1 − u), which weights the
late steps most.

The reference is a flow model pretrained longer (``reference_pretrain_steps``), the student one
pretrained briefly from another seed (both the same kind of model); one distillation step
(``updates`` Adam steps on ``batch`` visited states, the same on every rank; with the Megatron
model each data-parallel replica computes its share of the loss) per RL step, in a step hook that
holds the run's language-model policy still.

Provenance: reconstructed (no source found beyond the method's description): the weight w(u), the
discretisation, the visited-state sampling and the KL-OPD baseline's σ are our choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.methods.gradients import flow_model as fm
from megarl.methods.gradients.flow_megatron import ShardedFlow
from megarl.methods.gradients.flow_run import FlowHook, FlowKnobs, PlainFlow, as_flow, make_flow
from megarl.plugin.spec import MethodParts, MethodSpec

OBJECTIVES = ("flowcts", "kl_opd")


@dataclass
class FlowCTSKnobs(FlowKnobs):
    """objective: flowcts | kl_opd; supervision: N; own_paths: each field on its own path (else the
    reference at the student's point); through_path: back-propagate through the student's Euler
    steps; batch: visited states per update; updates: Adam steps per RL step;
    reference_pretrain_steps: the reference's flow-matching steps; a: the KL-OPD σ scale."""

    objective: str = "flowcts"
    supervision: int = 4
    own_paths: bool = True
    through_path: bool = False
    batch: int = 128
    updates: int = 2
    reference_pretrain_steps: int = 800
    pretrain_steps: int = 50
    a: float = 0.7

    def check(self) -> None:
        """Ranges and names."""
        super().check()
        if self.objective not in OBJECTIVES:
            raise ValueError(f"method.objective={self.objective!r}; known: {', '.join(OBJECTIVES)}")
        if self.supervision < 1 or self.batch < 1 or self.updates < 1:
            raise ValueError("method.supervision, method.batch and method.updates must be >= 1")
        if self.reference_pretrain_steps < 0 or self.a <= 0:
            raise ValueError("method.reference_pretrain_steps >= 0 and method.a > 0")


def field_of(model):
    """The FlowCTS-time field of a velocity model: f(x, τ) = −v(x, 1 − τ)."""
    return lambda x, tau: -model(x, 1.0 - tau)


def cts_weight(u: torch.Tensor, t_k: torch.Tensor) -> torch.Tensor:
    """w(u) = ½[(1 − t_k)² − (u − t_k)²]."""
    return 0.5 * ((1 - t_k) ** 2 - (u - t_k) ** 2)


def flowcts_terms(f_s, f_r, x: torch.Tensor, t_k: torch.Tensor, n: int, own_paths: bool = True,
                  through_path: bool = True) -> torch.Tensor:  # fmt: skip
    """[B]: L_N of every start state x [B, d] at its own t_k [B] (see the module docstring)."""
    h = (1 - t_k) / n
    xs, xr = x, x
    total = torch.zeros(x.shape[0], dtype=x.dtype)
    for j in range(n):
        u = t_k + j * h
        fs = f_s(xs if through_path else xs.detach(), u)
        with torch.no_grad():
            fr = f_r(xr if own_paths else xs, u)
        total = total + cts_weight(u, t_k) * ((fs - fr) ** 2).sum(-1) * h
        xs = xs + h[:, None] * fs
        xr = xr + h[:, None] * fr if own_paths else xs
    return total


def kl_opd_terms(f_s, f_r, x: torch.Tensor, t_k: torch.Tensor, n: int, a: float,
                 through_path: bool = True) -> torch.Tensor:  # fmt: skip
    """[B]: Σ_j h ‖f_S − f_R‖² / (2 σ²(u_j)) along the student's path, σ² = a² (1 − u)/max(u, h)."""
    h = (1 - t_k) / n
    xs = x
    total = torch.zeros(x.shape[0], dtype=x.dtype)
    for j in range(n):
        u = t_k + j * h
        xin = xs if through_path else xs.detach()
        fs = f_s(xin, u)
        with torch.no_grad():
            fr = f_r(xin, u)
        sig2 = a * a * (1 - u) / torch.maximum(u, h)
        total = total + h * ((fs - fr) ** 2).sum(-1) / (2 * sig2)
        xs = xs + h[:, None] * fs
    return total


def visited_states(model, n: int, steps: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` student-visited states and their FlowCTS times: the student's Euler ODE path from noise,
    stopped at a uniformly drawn grid step k < K (τ = k/K)."""
    noise = torch.randn(n, 2, generator=gen)
    traj = fm.sample(model, noise, steps, "lc", 0.0, gen)[0]  # a = 0: the Euler ODE
    k = torch.randint(0, steps, (n,), generator=gen)
    return traj[k, torch.arange(n)], k.to(noise.dtype) / steps


@torch.no_grad()
def endpoint_error(student, reference, n: int, steps: int, gen: torch.Generator) -> float:
    """Mean ‖x^S(1) − x^R(1)‖² of the two Euler ODE samplers from the same noise."""
    noise = torch.randn(n, 2, generator=gen)
    a = fm.sample(student, noise, steps, "lc", 0.0, gen)[0][-1]
    b = fm.sample(reference, noise, steps, "lc", 0.0, gen)[0][-1]
    return float(((a - b) ** 2).sum(-1).mean())


class FlowCTSHook(FlowHook):
    """One distillation step per RL step; see the module docstring. ``student``, ``reference``:
    velocity modules or flow learners (else the ones the knobs name, under ``ctx``'s groups)."""

    def __init__(self, knobs: FlowCTSKnobs, student=None, reference=None, ctx=None):
        k = knobs
        if student is None:
            student = make_flow(k, ctx, k.seed + 1, k.pretrain_steps)
        super().__init__(as_flow(student, k.lr))
        if reference is None:
            reference = make_flow(k, ctx, k.seed, k.reference_pretrain_steps)
            reference = reference.model if isinstance(reference, PlainFlow) else reference
        self.reference = reference
        ref_module = reference if isinstance(reference, torch.nn.Module) else reference.model
        for p in ref_module.parameters():
            p.requires_grad_(False)
        self.knobs = knobs

    def terms(self, x: torch.Tensor, t_k: torch.Tensor) -> torch.Tensor:
        """[B]: the configured objective's term of every state."""
        k, f_s, f_r = self.knobs, field_of(self.model), field_of(self.reference)
        if k.objective == "flowcts":
            return flowcts_terms(f_s, f_r, x, t_k, k.supervision, k.own_paths, k.through_path)
        return kl_opd_terms(f_s, f_r, x, t_k, k.supervision, k.a, k.through_path)

    def loss(self, x: torch.Tensor, t_k: torch.Tensor) -> torch.Tensor:
        """The configured objective, averaged over the states."""
        return self.terms(x, t_k).mean()

    def share_loss(self, x: torch.Tensor, t_k: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """The states ``part``'s terms summed and divided by the whole batch's size (the replicas'
        shares add up to the mean)."""
        return self.terms(x[part], t_k[part]).sum() / x.shape[0]

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        """``updates`` Adam steps on freshly visited states; the endpoint error after them."""
        k = self.knobs
        gen = torch.Generator().manual_seed(k.seed * 1_000_003 + step)
        before = self.flow.flat()
        loss = 0.0
        micro = self.flow.micro_batches(self.flow.dp_share(k.batch), k.micro_batches)
        for _ in range(k.updates):
            x, t_k = visited_states(self.model, k.batch, k.steps, gen)
            if isinstance(self.flow, PlainFlow):  # the whole batch's mean
                loss, _ = self.flow.train_step(lambda x=x, t_k=t_k: self.loss(x, t_k))
            else:
                fns = [lambda x=x, t_k=t_k, c=c: self.share_loss(x, t_k, c) for c in micro]
                loss, _ = self.flow.train_step(fns)
        self.updates += 1
        err = endpoint_error(self.model, self.reference, 256, k.steps, torch.Generator().manual_seed(k.seed))
        return {
            f"flowcts/{k.objective}_loss": loss,
            "flowcts/endpoint_error": err,
            "flowcts/update_norm": float((self.flow.flat() - before).norm()),
            **self.flow_metrics("flowcts"),
        }

    def state_dict(self) -> dict:
        """The update count; the replicated student, its optimizer and the reference."""
        if not isinstance(self.flow, PlainFlow):
            return super().state_dict()
        return {**super().state_dict(), "reference": self.reference.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""
        super().load_state_dict(state)
        if isinstance(self.flow, PlainFlow):
            self.reference.load_state_dict(state["reference"])


class ShardedFlowCTSHook(ShardedFlow, FlowCTSHook):
    """FlowCTS on the Megatron flow models: student and reference saved per rank in every checkpoint."""

    def sharded_learners(self) -> dict:
        """The student and the reference."""
        return {"model": self.flow, "reference": self.reference}


def build(ctx, knobs: FlowCTSKnobs) -> MethodParts:
    """The FlowCTS step hook on every rank (its flow models under the run's groups)."""
    cls = ShardedFlowCTSHook if knobs.model == "megatron" else FlowCTSHook
    return MethodParts(step_hooks=[cls(knobs, ctx=ctx)])


SPEC = MethodSpec(
    name="flowcts",
    summary="on-policy distillation of a flow model: trajectory-bound-weighted velocity matching",
    provenance="reconstructed",
    knobs=FlowCTSKnobs,
    build=build,
)
