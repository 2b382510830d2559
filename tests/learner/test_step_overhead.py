"""The one-process learner's step skips work that cannot change a number, and its numbers are those
of the full path: no gradient reduce-scatter or parameter all-gather over a group of one process
(megarl/learner/ddp.py), the CPU shims' device mode off in a dense model's forward and in the torch
optimizer's step, RoPE's cos/sin computed once per forward (cpu_shims P11); a checkpoint save
spawns no ``multiprocessing`` Manager server for the writer's results (megarl/learner/dist_checkpoint.py)."""

from __future__ import annotations

import contextlib

import torch

from megarl.learner import cpu_shims
from megarl.learner import forward as fwd
from megarl.learner.learner import Learner
from megarl.learner.parallel import ParallelLayout, initialize_parallel
from megarl.objectives.rl_objective import build_objective
from tests.learner.dist_cases import make_batch
from tests.learner.test_old_logprobs_reuse import HF, VOCAB, _learner


def _full_path(ln: Learner) -> None:
    """Put megatron's collectives and the torch optimizer's own step back on ``ln``."""
    for group in ln.ddp.bucket_groups + ln.ddp.expert_parallel_bucket_groups:
        del group.start_grad_sync, group.start_param_sync
    for part in getattr(ln.optimizer, "chained_optimizers", [ln.optimizer]):
        del part.optimizer.step


class _Counts:
    """Calls of the bucket collectives and of the device mode, while active."""

    def __init__(self, monkeypatch):
        from megatron.core.distributed import param_and_grad_buffer as pgb

        self.collectives = 0
        self.mode_calls = 0
        for name in ("dist_reduce_scatter_func", "dist_all_gather_func"):
            original = getattr(pgb, name)

            def counted(*args, _f=original, **kwargs):
                self.collectives += 1
                return _f(*args, **kwargs)

            monkeypatch.setattr(pgb, name, counted)
        mode_fn = cpu_shims._CudaToCpuMode.__torch_function__

        def counted_mode(mode, func, types, args=(), kwargs=None):
            self.mode_calls += 1
            return mode_fn(mode, func, types, args, kwargs)

        monkeypatch.setattr(cpu_shims._CudaToCpuMode, "__torch_function__", counted_mode)


def test_one_process_step_skips_collectives_and_the_mode_with_the_same_numbers(monkeypatch):
    objective = build_objective({"policy_loss": "ppo", "clip_low": 0.2, "clip_high": 0.2})
    batch = make_batch(5, (9, 6, 11, 6, 8, 5), vocab=VOCAB)
    lean, full = _learner(), _learner()
    _full_path(full)
    counts = _Counts(monkeypatch)
    in_model = {"lean": 0, "full": 0}
    for name, ln in (("lean", lean), ("full", full)):  # device-mode calls inside the model's forward

        def pre(module, args, kwargs, _name=name):
            in_model[_name] -= counts.mode_calls

        def post(module, args, kwargs, out, _name=name):
            in_model[_name] += counts.mode_calls

        ln.model.register_forward_pre_hook(pre, with_kwargs=True)
        ln.model.register_forward_hook(post, with_kwargs=True)
    m_lean = [lean.train_step(batch, objective, 2) for _ in range(2)][-1]
    assert counts.collectives == 0
    assert in_model["lean"] == 0  # the dense forward ran outside the device mode
    monkeypatch.setattr(fwd, "_device_mode_off", lambda inner: contextlib.nullcontext())
    m_full = [full.train_step(batch, objective, 2) for _ in range(2)][-1]
    assert counts.collectives > 0 and in_model["full"] > 0
    assert m_lean == m_full
    for (name, a), b in zip(lean.model.named_parameters(), full.model.parameters()):
        assert torch.equal(a, b), name


def test_rope_reuses_cos_sin_with_the_same_numbers():
    from megatron.core.models.common.embeddings import rope_utils

    initialize_parallel(ParallelLayout())  # applies the shims
    g = torch.Generator().manual_seed(0)
    freqs = torch.rand(7, 1, 1, 8, generator=g) * 6
    t = torch.randn(7, 1, 4, 8, generator=g, requires_grad=True)
    w = torch.randn(7, 1, 4, 8, generator=g)
    cos_calls = []
    real_cos = torch.cos

    def cos(x):
        cos_calls.append(x)
        return real_cos(x)

    patched = rope_utils._apply_rotary_pos_emb_bshd
    original = patched.__closure__ and next(
        c.cell_contents
        for c in patched.__closure__
        if getattr(c.cell_contents, "__name__", "") == "_apply_rotary_pos_emb_bshd"
    )
    assert original is not None and original is not patched
    torch.cos = cos
    try:
        out = [patched(t, freqs) for _ in range(3)]  # query and keys of several layers
    finally:
        torch.cos = real_cos
    assert len(cos_calls) == 1
    ref = original(t, freqs)
    (g_out,) = torch.autograd.grad((out[0] * w).sum(), t)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), t)
    assert all(torch.equal(o, ref) for o in out)
    assert torch.equal(g_out, g_ref)


def test_checkpoint_save_starts_no_manager_process(tmp_path):
    import multiprocessing
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megarl.learner.dist_checkpoint import load_checkpoint, save_checkpoint

    ln = _learner()
    ln.train_step(make_batch(5, (9, 6), vocab=VOCAB), build_objective({"policy_loss": "ppo"}), 1)
    save_checkpoint(ln, tmp_path / "a")
    save_checkpoint(ln, tmp_path / "b")
    assert isinstance(filesystem_async._results_queue, queue.Queue)
    assert multiprocessing.active_children() == []  # the bucket writers are joined; no server lives on
    fresh = _learner()
    load_checkpoint(fresh, tmp_path / "b")
    for (name, a), b in zip(ln.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(a, b), name


def test_megatron_imports_without_torch_compiler_stack():
    import subprocess
    import sys

    probe = (
        "import sys, torch; from megarl.learner.megatron_import import import_megatron; import_megatron(); "
        "import megatron.core.jit as j; print('torch._inductor' in sys.modules, j.jit_fuser is torch.compile)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]


def test_deferred_compile_calls_the_real_one_at_first_use():
    from megarl.learner.megatron_import import _deferred

    made = []

    def real(fn, **kwargs):
        made.append(kwargs)
        return lambda *a: ("compiled", fn(*a))

    def double(x):
        return 2 * x

    lazy = _deferred(real)(double)
    assert made == [] and lazy.__name__ == "double"
    assert lazy(3) == ("compiled", 6) and lazy(4) == ("compiled", 8)
    assert made == [{}]
    assert _deferred(real)(mode="max-autotune")(double)(1) == ("compiled", 2)
    assert made[-1] == {"mode": "max-autotune"}


def test_gated_mlp_gives_megatron_mlp_numbers(caplog):
    import logging
    import types

    from megatron.core.transformer.mlp import MLP

    from megarl.learner.forward import packed_inputs, run_model
    from megarl.learner.model import build_gpt_model, layer_spec

    torch.manual_seed(0)
    groups = initialize_parallel(ParallelLayout())
    with caplog.at_level(logging.WARNING):
        model = build_gpt_model(HF, groups)
    assert not [r for r in caplog.records if "Unknown MLP type" in r.getMessage()]
    mlps = [layer.mlp for layer in model.decoder.layers]
    assert all(type(m).__name__ == "GatedMLP" for m in mlps)
    # its TP group comes from the spec (megatron's layer passes one to its own MLP class only)
    local = layer_spec(model.config, model.megarl_spec, groups)
    assert local.submodules.mlp.params["tp_group"] is groups.pg_collection.tp
    tokens, cu = torch.randint(0, VOCAB, (13,)), torch.tensor([0, 6, 13])

    def run():
        model.zero_grad(set_to_none=True)
        out = run_model(model, packed_inputs(tokens, cu, torch.device("cpu")))
        (out.float().square().mean()).backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    out, grads = run()
    for m in mlps:
        m.forward = types.MethodType(MLP.forward, m)  # megatron's own forward
    ref, ref_grads = run()
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
