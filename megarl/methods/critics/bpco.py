"""BPCO (Best-Practice Critic Optimization): a single-rollout PPO recipe on the Megatron critic.

Every piece is a knob of a shared part, so BPCO is a configuration of them:

- length-adaptive GAE: ``advantage: {estimator: gae, lam_alpha: 0.4}``, λ_i = 1 − 1/(α·L_i) per
  response, clamped to [0, 1] (below L = 1/α the formula is negative; megarl makes it λ = 0);
- Monte Carlo value targets: ``inputs.values.targets: monte_carlo`` (the reward-to-go, the outcome
  reward at γ = 1), not the GAE returns;
- unnormalised advantages: ``inputs.values.whiten_advantages: false`` (the default);
- values bounded to the reward range: ``inputs.values.bounds: [0, 1]`` (sigmoid squash);
- DPPO's probability-difference trust region: ``objective.policy_loss: dppo_tv`` (or ``dppo_kl``),
  aggregated ``seq-mean-token-sum``;
- critic warm-up: ``inputs.values.warmup_steps`` RL steps that train the critic only.

Provenance: the authors' code (QPHutu/golden_critic: ``compute_lagae_advantage_return``, the
``dppo_tv``/``dppo_kl`` policy losses, ``run_math_deepscaler.sh``: α = 0.4, critic warm-up 15 steps,
one rollout per prompt). The bounded values are reconstructed (not located in the code read).
Reference: reference/critics.py ``lagae``.
"""

from __future__ import annotations

from megarl.plugin.spec import MethodSpec

SPEC = MethodSpec(
    name="bpco",
    summary="single-rollout PPO: length-adaptive GAE, Monte Carlo value targets, bounded values, DPPO-TV",
    provenance="code",
    config={
        "advantage": {"estimator": "gae", "gamma": 1.0, "lam_alpha": 0.4},
        "objective": {"policy_loss": "dppo_tv", "aggregation": "seq-mean-token-sum"},
        "inputs": {
            "values": {
                "targets": "monte_carlo",
                "bounds": [0.0, 1.0],
                "whiten_advantages": False,
                "warmup_steps": 0,
            }
        },
    },
    inputs=("values",),
)
