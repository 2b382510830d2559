"""Method family 2, credit: critic-free advantage estimators and token/segment/step credit.

Importing this package registers ``softmax_grpo``, ``gepo``, ``dash``, ``gigpo``, ``pgpo`` in
ADVANTAGE_ESTIMATORS and the ``taco`` policy loss in POLICY_LOSSES.
"""

from megarl.methods.credit import dash, gepo, gigpo, pgpo, softmax_grpo, taco  # noqa: F401
