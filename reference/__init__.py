"""Plain-PyTorch reference implementations of every megarl objective.

Read these files top to bottom: padded tensors ``[B, L]``, full-vocabulary logits ``[B, L, V]``,
no process groups, no registry. Each function states its formula and where the formula comes
from. The property tests in tests/property prove megarl's scaled code computes the same numbers.
"""
