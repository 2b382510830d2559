"""ES: evolution strategies on the full parameter vector, evaluated through the rollout engine.

Per RL step (from ``method.start_step`` on; GRPO before it, so ``start_step: T1 + 1`` is the
sequential GRPO -> ES schedule):

1. N member seeds are derived from (seed, step) on every rank (nothing sent); with ``antithetic``
   each seed is evaluated at +σ and −σ (M = 2N members, else M = N);
2. per member every rank perturbs its own shards (``θ + s·σ·ε(seed)``, each TP/PP/EP shard
   regenerating its slice: megarl/methods/gradients/perturbation.py), the weights are pushed to the
   engine (``RunContext.push_weights``), rank 0 scores the member on the step's prompts (greedy by
   default, the mean of the run's scalar reward), and every rank restores θ bit for bit;
3. rank 0 broadcasts the M scalar rewards; every rank applies
   ``θ ← θ + α/(Mσ) Σ_m R̃_m s_m ε(seed_m)`` to its shards (R̃: z-scored by default).

The policy optimizer does not step on ES steps (the hook is a ``PolicyGate``); the step's ordinary
rollouts still run and log the current policy's reward. Only seeds (recomputed) and scalar rewards
cross ranks. Provenance: paper, ES (Salimans et al. 2017) as fine-tuning LLMs in Qiu et al. 2025
(arXiv 2509.24372: z-scored rewards, greedy member evaluation, no antithetic pairs there); their
N = 30, σ = 1e-3, α = 5e-4 are recalled defaults, not verified. The schedule knob is reconstructed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.methods.gradients.noise import tensor_key
from megarl.methods.gradients.perturbation import WeightPerturbation
from megarl.methods.gradients.three_po import check_sync_loop
from megarl.plugin.knobs import Knobs
from megarl.plugin.rounds import RolloutRound, RoundResult
from megarl.plugin.spec import MethodParts, MethodSpec

NORMALISATIONS = ("zscore", "center", "none")


@dataclass
class ESKnobs(Knobs):
    """population: N seeds per step; sigma: σ; lr: α; antithetic: evaluate ±σ per seed;
    normalise: zscore | center | none (R̃); greedy: members decode greedily (else at the rollout
    temperature); seed: the run's noise seed; start_step: the first ES step (GRPO before it)."""

    population: int = 8
    sigma: float = 1e-3
    lr: float = 5e-4
    antithetic: bool = True
    normalise: str = "zscore"
    greedy: bool = True
    seed: int = 0
    start_step: int = 1

    def check(self) -> None:
        """Ranges of every knob."""
        if self.population < 1:
            raise ValueError(f"method.population={self.population} must be >= 1")
        if self.sigma <= 0:
            raise ValueError(f"method.sigma={self.sigma} must be > 0")
        if self.lr < 0:
            raise ValueError(f"method.lr={self.lr} must be >= 0")
        if self.normalise not in NORMALISATIONS:
            raise ValueError(f"method.normalise={self.normalise!r}; allowed: {', '.join(NORMALISATIONS)}")
        if self.seed < 0 or self.start_step < 1:
            raise ValueError(
                f"method.seed >= 0 and method.start_step >= 1, got {self.seed}, {self.start_step}"
            )


def member_seeds(seed: int, step: int, population: int) -> list[int]:
    """The N noise seeds of ``step`` (31-bit, the same on every rank)."""
    out = []
    for n in range(population):
        k0, k1 = tensor_key(seed, f"es/step/{step}/member/{n}")
        out.append((k0 ^ k1) & 0x7FFFFFFF)
    return out


def members(seeds: list[int], antithetic: bool) -> list[tuple[int, float]]:
    """(seed, sign) of every member: (s, +1), (s, −1) per seed with ``antithetic``."""
    return [(s, sign) for s in seeds for sign in ((1.0, -1.0) if antithetic else (1.0,))]


def normalise(rewards: torch.Tensor, mode: str) -> torch.Tensor:
    """R̃ of the members' rewards [M] (float64)."""
    r = rewards.double()
    if mode == "zscore":
        return (r - r.mean()) / (r.std(unbiased=False) + 1e-8)
    if mode == "center":
        return r - r.mean()
    return r


def update_coefficients(
    mem: list[tuple[int, float]], rewards: torch.Tensor, sigma: float, lr: float, mode: str
) -> tuple[list[int], list[float]]:
    """The ES update as ``Σ_seed c_seed ε(seed)``: c_seed = α/(Mσ) Σ_{members of seed} s_m R̃_m,
    seeds in first-appearance order."""
    rt = normalise(rewards, mode).tolist()
    coef: dict[int, float] = {}
    for (s, sign), r in zip(mem, rt):
        coef[s] = coef.get(s, 0.0) + lr / (len(mem) * sigma) * sign * r
    return list(coef), list(coef.values())


class StepPrompts:
    """Rank 0's round processor: keeps the prompts and answers of the current step's rounds (the
    minibatch the population is scored on)."""

    def __init__(self) -> None:
        self.step, self.prompt_ids, self.answers = -1, [], []

    async def process(self, r: RolloutRound) -> RoundResult:
        """Record the round's prompts (a new step starts a new list)."""
        if r.step != self.step:
            self.step, self.prompt_ids, self.answers = r.step, [], []
        self.prompt_ids += [list(p) for p in r.prompt_ids]
        self.answers += list(r.answers)
        return RoundResult()

    def state_dict(self) -> dict:
        """Nothing outlives a step."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


class ESUpdate:
    """The step hook (every rank); see the module docstring."""

    def __init__(self, ctx, knobs: ESKnobs, prompts: StepPrompts | None, perturbation=None, score=None):
        """``perturbation``: a ``WeightPerturbation`` (default: of the policy learner's model);
        ``score(step, member) -> float``: rank 0's member reward (default: the engine on the step's
        prompts)."""
        self.ctx, self.knobs, self.prompts = ctx, knobs, prompts
        self._perturbation = perturbation
        self.score = score or self._score
        self.updates = 0

    @property
    def perturbation(self) -> WeightPerturbation:
        """The policy learner's perturbation (made at first use)."""
        if self._perturbation is None:
            self._perturbation = WeightPerturbation.of_model(self.ctx.policy.model, self.ctx.groups)
        return self._perturbation

    def updates_policy(self, step: int) -> bool:
        """The policy optimizer steps only before ``start_step``."""
        return step < self.knobs.start_step

    def before_train(self, step, batch):
        """Nothing before the (skipped) update."""
        return batch

    def _score(self, step: int, m: int) -> float:
        """Rank 0: the member's mean reward on the step's prompts."""
        ctx, p = self.ctx, self.prompts
        # the same sampling seeds for every member (common random numbers): members differ by weights only
        params = [ctx.sampling(step, 1000, i, greedy=self.knobs.greedy) for i in range(len(p.prompt_ids))]

        async def generate_all() -> list:  # gathered inside the engine's loop
            return await asyncio.gather(
                *[ctx.engine.generate(ids, n=1, sampling=sp) for ids, sp in zip(p.prompt_ids, params)]
            )

        outs = ctx.run_coroutine(generate_all())
        texts = [ctx.tokenizer.decode(o.samples[0].token_ids) for o in outs]
        return float(ctx.score(texts, p.answers).scalar.double().mean())

    def after_step(self, step: int, metrics: dict) -> dict[str, float]:
        """Evaluate the population and apply the ES update (collective)."""
        k = self.knobs
        if step < k.start_step:
            return {"es/active": 0.0}
        mem = members(member_seeds(k.seed, step, k.population), k.antithetic)
        rewards: list[float] = []
        for m, (s, sign) in enumerate(mem):
            with self.perturbation.applied(s, sign * k.sigma):
                self.ctx.push_weights("es-member")  # one export folder for all members (server engines)
                if self.ctx.rank0:
                    rewards.append(self.score(step, m))
        box = [rewards]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        r = torch.tensor(box[0], dtype=torch.float64)
        seeds, coeffs = update_coefficients(mem, r, k.sigma, k.lr, k.normalise)
        self.perturbation.add_noise_sum(seeds, coeffs)
        self.updates += 1
        return {
            "es/active": 1.0,
            "es/reward_mean": float(r.mean()),
            "es/reward_std": float(r.std(unbiased=False)),
            "es/reward_max": float(r.max()),
            "es/members": float(len(mem)),
            "es/updates_total": float(self.updates),
        }

    def state_dict(self) -> dict:
        """The number of ES updates so far (seeds are a function of (seed, step))."""
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        """Restore the update count."""
        self.updates = int(state.get("updates", 0))


def build(ctx, knobs: ESKnobs) -> MethodParts:
    """The ES hook on every rank; the prompt recorder on rank 0."""
    check_sync_loop(ctx.cfg, "es")
    if ctx.cfg.model.params_dtype != "float32":
        raise ValueError(
            f"method es updates float32 weights: set model.params_dtype: float32, "
            f"got {ctx.cfg.model.params_dtype}"
        )
    if ctx.push_weights is None or ctx.run_coroutine is None:
        raise ValueError(
            "method es needs a run that can push weights to its engine (RunContext.push_weights)"
        )
    prompts = StepPrompts() if ctx.rank0 else None
    return MethodParts(
        round_processors=[prompts] if ctx.rank0 else [], step_hooks=[ESUpdate(ctx, knobs, prompts)]
    )


SPEC = MethodSpec(
    name="es",
    summary="evolution strategies: seeded full-parameter perturbations scored through the engine",
    provenance="paper",
    config={"advantage": {"estimator": "grpo"}},
    knobs=ESKnobs,
    build=build,
)
