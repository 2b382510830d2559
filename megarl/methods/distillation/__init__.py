"""Method family 4, distillation: teacher signals (a Megatron or engine-served teacher, top-K, full
vocabulary, a self-teacher with privileged context), per-group routes and the methods built on them.

Importing this package registers the family's objective parts and batch-input providers.
"""

from megarl.methods.distillation import routes  # noqa: F401
from megarl.methods.distillation import self_teacher  # noqa: F401
