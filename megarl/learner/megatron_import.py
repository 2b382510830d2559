"""Import megatron-core without importing torch's compiler stack.

megatron-core's ``megatron.core.jit`` sets ``jit_fuser = torch.compile`` when it is imported, and a
dozen of its modules decorate functions with it at import time; the first ``torch.compile(fn)``
imports torch._dynamo and torch._inductor (about two thirds of megatron-core's import time on CPU),
although the learner calls none of those fused functions (every fusion is off). ``import_megatron``
imports ``megatron.core`` once with a ``torch.compile`` that defers the real call to the decorated
function's first use; ``torch.compile`` itself is restored right after. A function that is called
is compiled then, as ``torch.compile`` would have compiled it then too.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch


def _deferred(real: Any) -> Any:
    """A ``torch.compile`` that wraps a plain function and calls ``real`` at its first call."""

    def compile_later(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # used as @torch.compile(**kwargs)
            return lambda fn: compile_later(fn, **kwargs)
        if not inspect.isfunction(model):
            return real(model, **kwargs)
        compiled: list = []

        @functools.wraps(model)
        def call(*args: Any, **kw: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **kwargs))
            return compiled[0](*args, **kw)

        return call

    return compile_later


def import_megatron() -> None:
    """Import ``megatron.core`` (once per process) with ``torch.compile`` deferred."""
    if "megatron.core" in sys.modules:
        return
    real = torch.compile
    torch.compile = _deferred(real)  # type: ignore[assignment]
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = real
