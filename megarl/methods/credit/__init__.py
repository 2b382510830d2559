"""Method family 2, credit: critic-free advantage estimators and token/segment/step credit.

Importing this package registers the advantage estimators ``softmax_grpo``, ``gepo``, ``dash``,
``gigpo``, ``pgpo``, ``rspo``, ``rrpo``, the ``taco`` policy loss, and the batch-input providers
these need (``steps``, ``answer_checkpoints``, ``rrpo_scores``).
"""

from megarl.methods.credit import (  # noqa: F401
    dash,
    gepo,
    gigpo,
    pgpo,
    rrpo,
    rrpo_scores,
    rspo,
    softmax_grpo,
    step_inputs,
    taco,
)
