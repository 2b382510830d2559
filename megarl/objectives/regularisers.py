"""Extra loss terms registered by name and listed in ``objective.regularisers``.

Signature: ``fn(logits [T, V/tp], logp [T], old_logp [T], batch, ctx, **knobs) -> [T]`` per-token
loss; the composed objective aggregates it like every other part and multiplies it by ``coef``.
Method families (e.g. CoKL) register theirs here.
"""

from __future__ import annotations

from megarl.registry import Registry

REGULARISERS: Registry = Registry("regulariser")
