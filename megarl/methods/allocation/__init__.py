"""Method family 6, allocation: which prompts get rollouts and how many (streaming allocators,
curricula, data selection, rollout acceleration).

Importing this package registers the family's allocators and parts.
"""

from megarl.methods.allocation import (
    llmzero,  # noqa: F401
    mass,  # noqa: F401
    pac,  # noqa: F401
    pair,  # noqa: F401
    sara,  # noqa: F401
    specroll,  # noqa: F401
    trajval,  # noqa: F401
)
