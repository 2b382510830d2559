"""Method family 7, gradient level: per-group gradient information, update projection,
parameter-space perturbation and the methods built on them.

Importing this package registers the family's parts.
"""

from megarl.methods.gradients import (  # noqa: F401
    agon,
    es,
    flowcts,
    gcpo,
    gupo,
    lc_grpo,
    three_po,
)
