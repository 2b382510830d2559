"""Method family 4, distillation: teacher signals (a Megatron or engine-served teacher, top-K, full
vocabulary, a self-teacher with privileged context), per-group routes and the methods built on them.

Importing this package registers the family's objective parts and batch-input providers.
"""

from megarl.methods.distillation import (
    distilled_rl,  # noqa: F401
    geosd,  # noqa: F401
    isdpo,  # noqa: F401
    opd_regulation,  # noqa: F401
    opdvr,  # noqa: F401
    ra_opd,  # noqa: F401
    routes,  # noqa: F401
    rstg,  # noqa: F401
    sc_grpo,  # noqa: F401
    self_routing,  # noqa: F401
    self_teacher,  # noqa: F401
    skald,  # noqa: F401
    tide,  # noqa: F401
    uopsd,  # noqa: F401
)
