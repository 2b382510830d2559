"""Megatron-core learner: parallel state, model provider, logprob pass, training step, checkpoints.

Nothing here imports ``megarl.learner.cpu_shims`` at module import time: the shims are applied by
``megarl.learner.parallel.initialize_parallel`` only when no CUDA device is used.
"""
