"""Slurm launch: node roles, torch.distributed variables, rollout server start-up and address hand-over,
pre-emption and resume. ``python -m megarl.launch`` is the per-node launcher (run by srun); see docs/slurm.md.

Only the standard library is imported here; ``megarl.launch.dist`` and ``megarl.launch.selftest`` need torch.
"""
