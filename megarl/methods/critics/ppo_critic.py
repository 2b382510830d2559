"""PPO with GAE and a learned critic: the textbook baseline of actor-critic RL for LLMs.

Advantages from GAE over the critic's values (``inputs.values``: megarl.methods.critics.critic),
PPO's clipped policy loss, the critic trained on the GAE returns in the same step. One sample per
prompt is the usual setting (the critic, not a group, is the baseline).

Provenance: from the paper (Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; GAE:
Schulman et al. 2016); value clipping as in the PPO reference implementations.
"""

from __future__ import annotations

from megarl.plugin.spec import MethodSpec

SPEC = MethodSpec(
    name="ppo_critic",
    summary="PPO with GAE advantages from a Megatron critic trained beside the policy",
    provenance="paper",
    config={
        "advantage": {"estimator": "gae", "gamma": 1.0, "lam": 0.95},
        "objective": {"policy_loss": "ppo"},
    },
    inputs=("values",),
)
