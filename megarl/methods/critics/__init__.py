"""Critics and values: the ``values`` input (a Megatron critic) and the methods built on it."""

from megarl.methods.critics import critic  # noqa: F401  (registers the ``values`` provider)
