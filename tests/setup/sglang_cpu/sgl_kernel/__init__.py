"""Import-time stand-in for SGLang's CUDA-only ``sgl_kernel`` package on a CPU-only host.

PyPI ships ``sgl_kernel`` only as CUDA wheels. SGLang imports names from it at module load, but on CPU
with ``--attention-backend torch_native`` it takes its pure-torch paths and calls none of them. Every
attribute therefore resolves to a function that raises if it is ever called, naming the kernel.
"""

__version__ = "0.0.0+cpu-stub"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _not_on_cpu(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU implementation (megarl's CPU stub)")

    _not_on_cpu.__name__ = name
    return _not_on_cpu
