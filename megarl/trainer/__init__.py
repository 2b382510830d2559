"""The trainer: typed config, the synchronous RL loop, run-directory checkpoints, metrics, CLI."""
