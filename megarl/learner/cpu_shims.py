"""CPU shims that let megatron-core 0.16.1 run real TP/PP/EP/SP steps on CPU with gloo.

This is the ONE place where megarl patches megatron-core or ``torch.cuda`` behaviour. It is applied
by ``apply_cpu_shims()`` only when the learner runs without a CUDA device; GPU code paths never
import this module (tests/learner/test_cpu_shims.py checks that in a subprocess).

Shims (P1..P9):

- P1 ``torch.cuda.current_device()`` returns the CPU device (RoPE and others allocate on it).
- P2 CUDA RNG get/set/seed (torch.cuda and megatron's tensor_parallel.random helpers) use the CPU RNG.
- P4 ``WrappedTorchNorm`` refuses ``sequence_parallel``; we build it with the flag off and mark its
  parameters ``sequence_parallel`` so their grads get all-reduced over the TP group.
- P5 ``torch.cuda.Stream/current_stream/stream/Event`` become harmless stand-ins.
- P6 ``moe_utils.te_general_gemm`` is only defined when TE imports; define it as ``None``.
- P7 ``maybe_move_tensor_to_cpu(as_numpy=True)`` only converts CUDA tensors; convert CPU ones too.
- P8 ``device='cuda'`` arguments map to CPU and ``Tensor.cuda()`` is a no-op (a global
  ``TorchFunctionMode``), for schedules, grad buffers, optimizer and clip_grads.
- P9 ``Tensor.type()`` of a CPU float tensor reads as ``torch.cuda.*Tensor`` for the optimizer's asserts.
  Only while the P8 mode is active, and only for the string form (``t.type()`` with no argument).
- P8/P9 are off where nothing names a CUDA device and the mode's Python call on every torch
  function and tensor attribute costs the most: ``device_mode_off()`` around the forward of a model
  without MoE layers (megarl/learner/forward.py; megatron's MoE aux-loss tracker allocates on
  ``device="cuda"``) and around the inner torch optimizer's step (``inner_steps_without_device_mode``).
- P11 RoPE (``rope_utils._apply_rotary_pos_emb_bshd``, the unfused path every CPU layer takes): the
  cos/sin of a position tensor are computed once and reused by the query and key of every layer of
  the forward (megatron computes them again for each), and a rotation over the whole head dimension
  returns its result instead of concatenating it with an empty pass-through part; the same numbers.
- P10 ``one_process_groups()``: in a world of one process, megatron's groups (tensor, pipeline, data,
  expert, ... all of them ``[0]``) are the default group instead of ~18 new gloo groups. Every gloo
  group owns a TCP loop thread that wakes every 10 ms, so 18 idle groups made ~1,800 voluntary
  context switches a second for the whole run; a collective over one process is the same on any group.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_MODE: _CudaToCpuMode | None = None

_CPU = torch.device("cpu")


def _is_cuda_device(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """P8/P9: every torch call that names a CUDA device is sent to the CPU instead."""

    _CPU_TO_CUDA_TYPE = {  # noqa: RUF012 (a constant table, never mutated)
        "torch.FloatTensor": "torch.cuda.FloatTensor",
        "torch.HalfTensor": "torch.cuda.HalfTensor",
        "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return self._CPU_TO_CUDA_TYPE.get(name, name)
        dev = kwargs.get("device")
        if dev is not None and (_is_cuda_device(dev) or isinstance(dev, int)):
            kwargs = dict(kwargs, device=_CPU)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        return func(*args, **kwargs)


class _FakeStream:
    """P5: a stream that does nothing (CPU work is synchronous)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _FakeEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _FakeEvent:
    """P5: an event that is always complete."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cpu_get_rng_state(device: Any = "cuda", *args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
    torch.default_generator.manual_seed(int(seed))


def _patch_torch_cuda() -> None:
    tc = torch.cuda
    tc.current_device = lambda: _CPU  # P1
    tc.get_rng_state = _cpu_get_rng_state  # P2
    tc.set_rng_state = _cpu_set_rng_state
    tc.random.get_rng_state = _cpu_get_rng_state
    tc.random.set_rng_state = _cpu_set_rng_state
    tc.manual_seed = _cpu_manual_seed
    tc.manual_seed_all = _cpu_manual_seed
    tc.Stream = _FakeStream  # P5
    tc.Event = _FakeEvent
    tc.current_stream = lambda *a, **k: _FakeStream()
    tc.default_stream = lambda *a, **k: _FakeStream()
    tc.stream = lambda *a, **k: contextlib.nullcontext()
    tc.synchronize = lambda *a, **k: None
    tc.empty_cache = lambda *a, **k: None


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()  # P2
    mrandom._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)
    # The tracker warns when the CPU RNG changes inside a "CUDA" fork: with P2 that is by design.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # P6

    original_move = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):  # P7
        out = original_move(tensor, as_numpy=as_numpy, record_stream=False)
        if as_numpy and torch.is_tensor(out):
            out = out.numpy()
        return out

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def wrapped_norm_new(
        cls,
        config,
        hidden_size,
        eps=1e-5,
        persist_layer_norm=False,
        zero_centered_gamma=False,
        normalization="LayerNorm",
    ):  # P4
        if not config.sequence_parallel:
            return original_new(
                cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization
            )
        config.sequence_parallel = False
        try:
            norm = original_new(
                cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization
            )
        finally:
            config.sequence_parallel = True
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(wrapped_norm_new)


def _patch_rope() -> None:
    """P11: megatron's unfused RoPE with the cos/sin of the last position tensor kept."""
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_bshd
    local = threading.local()  # .last: [freqs, its version, mscale, dtype, cos, sin] of this thread

    def apply_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        if multi_latent_attention or freqs.requires_grad or freqs.shape[-1] != t.shape[-1]:
            return original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        key = (freqs._version, mscale, t.dtype)
        last = getattr(local, "last", None)
        if last is not None and last[0] is freqs and tuple(last[1:4]) == key:
            cos_, sin_ = last[4], last[5]
        else:
            cos_ = (torch.cos(freqs) * mscale).to(t.dtype)
            sin_ = (torch.sin(freqs) * mscale).to(t.dtype)
            local.last = [freqs, *key, cos_, sin_]
        return (t * cos_) + (rope_utils._rotate_half(t, rotary_interleaved) * sin_)

    rope_utils._apply_rotary_pos_emb_bshd = apply_bshd


@contextlib.contextmanager
def one_process_groups():
    """P10: while active, megatron's ``create_group`` returns the default process group when the world
    is one process (its groups can only be ``[0]``); with more processes it is unchanged."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    original = ps.create_group

    def create_group(ranks=None, *args, **kwargs):
        if dist.get_world_size() == 1 and list(ranks or [0]) == [0]:
            return dist.group.WORLD
        return original(ranks, *args, **kwargs)

    ps.create_group = create_group
    try:
        yield
    finally:
        ps.create_group = original


@contextlib.contextmanager
def device_mode_off():
    """While active, this thread's torch calls skip the P8/P9 mode (when it is the innermost torch
    function mode), for code that names no CUDA device. Elsewhere, or without the shims, nothing."""
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    if _MODE is None or _get_current_function_mode() is not _MODE:
        yield
        return
    with _pop_mode_temporarily():
        yield


def inner_steps_without_device_mode(optimizer) -> None:
    """Run the torch optimizer inside each of megatron's (chained) optimizers with the P8/P9 mode
    off: ``torch.optim``'s Adam names no device, and its ~12 torch calls per parameter are most of
    the Python work of an optimizer step."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if inner is None or getattr(inner, "_megarl_mode_off", False):
            continue
        step = inner.step

        def step_without_mode(*args, _step=step, **kwargs):
            with device_mode_off():
                return _step(*args, **kwargs)

        inner.step = step_without_mode
        inner._megarl_mode_off = True


def apply_cpu_shims() -> None:
    """Apply P1..P9 and P11 once per process. Refuses to run when a CUDA device is available."""
    global _APPLIED, _MODE
    if _APPLIED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megarl.learner.cpu_shims must not be applied when a CUDA device is available")
    _patch_torch_cuda()
    _patch_megatron()
    _patch_rope()
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()  # kept active for the life of the process
    _APPLIED = True


def shims_applied() -> bool:
    """Whether ``apply_cpu_shims`` ran in this process."""
    return _APPLIED
