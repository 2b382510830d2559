"""Critics and values: the ``values`` input (a Megatron critic) and the methods built on it."""

from megarl.methods.critics import (
    comp_gae,  # noqa: F401  (comp_gae estimator, attention_concentration)
    critic,  # noqa: F401  (registers the ``values`` provider)
    prompt_value,  # noqa: F401  (prompt_value estimator: SAO's prompt-level baseline)
    sapo,  # noqa: F401  (sapo_gae estimator)
    shared,  # noqa: F401  (value_head regulariser: a value head on the policy's trunk)
)
