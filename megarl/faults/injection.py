"""Fault injection into one trainer step: hooks on the learner's megatron-core model, batch poison.

``Injector.arm(step)`` installs the hooks of the injections scheduled for ``step`` (they act on
every forward/backward until ``disarm()``), writes non-finite values into weights (``where:
weight``, put back by ``disarm()``) and raises the learning rate (``lr``, put back by ``disarm()``
unless the LR scheduler already moved it on); ``Injector.poison(batch, step)`` returns a corrupted
copy of the batch for ``poison`` injections. Kinds and knobs: megarl.faults.config.InjectionConfig.

A fault with ``expert: N`` addresses routed expert N of the MoE layer ``target`` by its global id;
under expert parallelism only the rank whose ``local_expert_indices`` hold N applies it, to its
local expert module, so the same config means the same expert at any layout.

Precision injections really compute in low precision on any device: the module's parameters are
swapped for float16 / bfloat16 copies and its inputs cast, so its matmuls, forward and backward,
run in that dtype (torch.autocast cannot do this on CPU: megatron's linear layers re-enter autocast
in backward only for CUDA). The fp16 *loss scale* is an emulation confined to the module boundary
(the gradient entering the module's output is multiplied by the scale and stored in float16, the
module's backward runs on it, and the gradients leaving through its inputs and parameters are
divided again), since megarl's learner has no fp16 mixed-precision optimizer.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.faults.config import InjectionConfig


class InjectionError(ValueError):
    """An injection names a module or parameter the model does not have, or cannot apply."""


def _pick(numel: int, fraction: float, seed: int) -> torch.Tensor:
    """Indices of ``max(1, round(fraction * numel))`` elements, fixed by ``seed``."""
    k = max(1, round(fraction * numel))
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(numel, generator=g)[:k]


def _map_first(output: Any, fn) -> Any:
    """Apply ``fn`` to the output tensor (megatron modules return ``(output, bias)`` tuples)."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (fn(output[0]),) + tuple(output[1:])
    raise InjectionError(f"cannot inject into a module output of type {type(output).__name__}")


def _write_value(t: torch.Tensor, value: float, fraction: float, seed: int) -> torch.Tensor:
    """A copy of ``t`` with the chosen elements set to ``value`` (differentiable elsewhere)."""
    flat = t.reshape(-1).clone()
    flat[_pick(flat.numel(), fraction, seed).to(flat.device)] = value
    return flat.view_as(t)


class _IntoLowPrecision(torch.autograd.Function):
    """Entry of a low-precision module: forward casts to ``dtype``; backward takes the module's
    (loss-scaled, ``dtype``) gradient back to fp32 and divides by ``loss_scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype, loss_scale: float) -> torch.Tensor:
        ctx.src_dtype, ctx.loss_scale = x.dtype, loss_scale
        return x.to(dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g.to(ctx.src_dtype) / ctx.loss_scale, None, None


class _OutOfLowPrecision(torch.autograd.Function):
    """Exit of a low-precision module: forward returns the ``dtype`` output as fp32; backward
    multiplies the incoming gradient by ``loss_scale`` and stores it in ``dtype`` (float16
    overflows to inf above 65504), so the module's whole backward runs loss-scaled in ``dtype``."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, dtype: torch.dtype, loss_scale: float) -> torch.Tensor:
        ctx.dtype, ctx.loss_scale = dtype, loss_scale
        return t.to(dtype).float()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return (g * ctx.loss_scale).to(ctx.dtype), None, None


class Injector:
    """The injections of a run, resolved against ``model`` (this rank's stage of a GPTModel).

    ``device_type``: 'cpu' or 'cuda' (for torch.autocast); ``vocab_size`` bounds poisoned tokens.
    Names are checked at construction so a typo fails before any step runs. On a pipeline stage
    that does not hold a module, its injection is a no-op there (another stage applies it).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        specs: list[InjectionConfig],
        device_type: str = "cpu",
        vocab_size: int = 0,
        check_names: bool = True,
        optimizer=None,
    ):
        self.model, self.specs, self.device_type, self.vocab_size = (
            model,
            list(specs),
            device_type,
            vocab_size,
        )
        self.optimizer = optimizer
        self.modules = dict(model.named_modules())
        self.params = dict(model.named_parameters())
        self._handles: list = []
        self._swapped: list = []
        self._weights: list = []  # (tensor, indices, saved values) written by where: weight
        self._lrs: list = []  # (param group, scheduled lr, spiked lr)
        if check_names:
            for i, s in enumerate(self.specs):
                self._check(i, s)

    def expert_module(self, s: InjectionConfig, key: str = "injection") -> str | None:
        """The name of this rank's module for routed expert ``s.expert`` of the MoE layer
        ``s.target``, or None when another expert-parallel rank holds it."""
        layer = self.modules.get(s.target.removesuffix(".experts"))
        indices = getattr(layer, "local_expert_indices", None)
        total = getattr(getattr(layer, "config", None), "num_moe_experts", None)
        if layer is None or indices is None or not total:
            raise InjectionError(
                f"{key}.target={s.target!r} with expert={s.expert}: not a MoE layer of the model "
                "(give the layer's mlp, e.g. 'decoder.layers.0.mlp')"
            )
        if s.expert >= total:
            raise InjectionError(f"{key}.expert={s.expert}: the layer {s.target} has {total} routed experts")
        if s.expert not in indices:
            return None
        base = s.target.removesuffix(".experts")
        name = f"{base}.experts.local_experts.{list(indices).index(s.expert)}"
        if name not in self.modules:
            raise InjectionError(
                f"{key}.expert={s.expert}: {base}.experts has no local_experts modules "
                "(a grouped-GEMM expert layer holds all experts in one tensor)"
            )
        return name

    def _target(self, s: InjectionConfig) -> str | None:
        """The module / parameter name the injection acts on here (None: another rank's expert,
        or a MoE layer another pipeline stage holds)."""
        if s.expert < 0:
            return s.target
        if s.target.removesuffix(".experts") not in self.modules:
            return None
        return self.expert_module(s)

    def _check(self, i: int, s: InjectionConfig) -> None:
        key = f"faults.inject[{i}]"
        if s.kind == "logits" and "output_layer" not in self.modules:
            return  # not the last pipeline stage
        if s.kind == "lr":
            if self.optimizer is None:
                raise InjectionError(f"{key}: an lr spike needs the learner's optimizer")
            return
        if s.expert >= 0:
            self.expert_module(s, key)
            return
        if s.kind in ("nan", "inf") and s.where == "weight":
            if s.target not in self.params and s.target not in self.modules:
                raise InjectionError(
                    f"{key}.target={s.target!r} is neither a parameter nor a module of the model"
                )
            return
        if s.kind in ("nan", "inf") and s.where == "grad":
            if s.target not in self.params:
                near = [n for n in self.params if s.target.split(".")[-1] in n][:5] or list(self.params)[:5]
                raise InjectionError(
                    f"{key}.target={s.target!r} is not a parameter of the model; e.g. {', '.join(near)}"
                )
        elif s.kind in ("nan", "inf", "fp16", "bf16") and s.target not in self.modules:
            near = [n for n in self.modules if n and s.target.split(".")[-1] in n][:5] or [
                n for n in self.modules if n.count(".") <= 3 and n
            ][:8]
            raise InjectionError(
                f"{key}.target={s.target!r} is not a module of the model; e.g. {', '.join(near)}"
            )

    def active(self, step: int) -> list[InjectionConfig]:
        """The injections scheduled for trainer step ``step``."""
        return [s for s in self.specs if s.step == step]

    # ------------------------------------------------------------------------------ hooks
    def arm(self, step: int, apply_lr: bool = True) -> list[InjectionConfig]:
        """Install the hooks of ``step``'s injections (poison excluded); returns what was armed.
        ``apply_lr=False``: an ``lr`` spike is reported as armed but the learning rate is left as
        the caller set it (a replay sets the recorded, already spiked, rate itself)."""
        self.disarm()
        armed = []
        for s in self.active(step):
            if s.kind == "poison":
                continue
            if s.kind == "lr":
                if apply_lr:
                    self._spike_lr(s.scale)
                armed.append(s)
                continue
            target = self._target(s)
            if target is None:
                armed.append(s)  # another expert-parallel rank holds the expert
                continue
            if s.where == "weight":
                val = float("nan") if s.kind == "nan" else float("inf")
                self._write_weights(target, val, s.fraction, s.seed)
            elif s.kind == "logits":
                mod = self.modules.get("output_layer")
                if mod is None:
                    continue
                self._handles.append(mod.register_forward_hook(self._logits_hook(s)))
            elif s.where == "grad":
                p = self.params.get(target)
                if p is None:
                    continue
                val = float("nan") if s.kind == "nan" else float("inf")
                self._handles.append(
                    p.register_hook(lambda g, s=s, val=val: _write_value(g, val, s.fraction, s.seed))
                )
            else:
                mod = self.modules.get(target)
                if mod is None:
                    continue
                if s.kind in ("nan", "inf"):
                    val = float("nan") if s.kind == "nan" else float("inf")
                    self._handles.append(
                        mod.register_forward_hook(
                            lambda m, a, out, s=s, val=val: _map_first(
                                out, lambda t: _write_value(t, val, s.fraction, s.seed)
                            )
                        )
                    )
                else:
                    dtype = torch.float16 if s.kind == "fp16" else torch.bfloat16
                    self._handles.append(
                        mod.register_forward_pre_hook(self._enter_low_precision(mod, dtype, s.loss_scale))
                    )
                    self._handles.append(
                        mod.register_forward_hook(self._exit_low_precision(dtype, s.loss_scale))
                    )
            armed.append(s)
        return armed

    def _spike_lr(self, scale: float) -> None:
        """Every param group's learning rate x ``scale`` until ``disarm``."""
        for g in self.optimizer.param_groups:
            spiked = g["lr"] * scale
            self._lrs.append((g, g["lr"], spiked))
            g["lr"] = spiked

    @torch.no_grad()
    def _write_weights(self, target: str, value: float, fraction: float, seed: int) -> None:
        """``value`` into ``fraction`` of the elements of parameter ``target`` or of each parameter
        of module ``target`` (in place; the old values are kept for ``disarm``)."""
        if target in self.params:
            tensors = [self.params[target]]
        else:
            tensors = [p for p in self.modules[target].parameters() if p.is_floating_point()]
        for p in tensors:
            if not p.data.is_contiguous():
                raise InjectionError(f"where: weight: a parameter of {target} is not contiguous")
            flat = p.data.view(-1)
            idx = _pick(flat.numel(), fraction, seed).to(flat.device)
            self._weights.append((flat, idx, flat[idx].clone()))
            flat[idx] = value

    def _logits_hook(self, s: InjectionConfig):
        def hook(module, args, output):
            def perturb(t: torch.Tensor) -> torch.Tensor:
                out = t * s.scale
                if s.noise:
                    g = torch.Generator(device=t.device).manual_seed(s.seed)
                    out = out + s.noise * torch.randn(t.shape, generator=g, device=t.device, dtype=t.dtype)
                return out

            return _map_first(output, perturb)

        return hook

    def _enter_low_precision(self, module: torch.nn.Module, dtype: torch.dtype, loss_scale: float):
        """Pre-hook: the module's parameters are swapped for ``dtype`` copies (cast nodes, so the
        gradient still reaches the fp32 parameters) and its floating-point inputs cast to ``dtype``."""

        def pre(mod, args):
            saved = []
            for owner in module.modules():
                for name, p in list(owner._parameters.items()):
                    if p is not None and p.is_floating_point():
                        saved.append((owner, name, p))
                        owner._parameters[name] = _IntoLowPrecision.apply(p, dtype, loss_scale)
            self._swapped.append(saved)
            return tuple(
                _IntoLowPrecision.apply(a, dtype, loss_scale)
                if isinstance(a, torch.Tensor) and a.is_floating_point()
                else a
                for a in args
            )

        return pre

    def _exit_low_precision(self, dtype: torch.dtype, loss_scale: float):
        """Post-hook: parameters restored, the output returned in fp32 through the low-precision
        boundary (its gradient is loss-scaled and stored in ``dtype``)."""

        def post(mod, args, output):
            if self._swapped:
                for owner, name, p in self._swapped.pop():
                    owner._parameters[name] = p
            return _map_first(output, lambda t: _OutOfLowPrecision.apply(t, dtype, loss_scale))

        return post

    def disarm(self) -> None:
        """Remove every installed hook."""
        for h in self._handles:
            h.remove()
        self._handles = []
        while self._swapped:  # a forward that raised inside an armed module: parameters back
            for owner, name, p in self._swapped.pop():
                owner._parameters[name] = p
        with torch.no_grad():
            for flat, idx, old in reversed(self._weights):
                flat[idx] = old
        self._weights = []
        for g, scheduled, spiked in reversed(self._lrs):
            if g["lr"] == spiked:  # the scheduler has not moved on (e.g. a skipped update)
                g["lr"] = scheduled
        self._lrs = []

    # ------------------------------------------------------------------------------ batch
    def poison(self, batch: PackedBatch, step: int) -> tuple[PackedBatch, list[InjectionConfig]]:
        """``batch`` with ``step``'s poison injections applied (a copy), and those injections."""
        specs = [s for s in self.active(step) if s.kind == "poison"]
        if not specs:
            return batch, []
        out = copy.copy(batch)
        for s in specs:
            if s.field == "advantages":
                if out.advantages is None:
                    raise InjectionError("poison of advantages: the batch has no advantages")
                out.advantages = out.advantages * s.scale
            else:
                resp = torch.nonzero(out.loss_mask > 0).flatten()
                if resp.numel() == 0:
                    continue
                idx = resp[_pick(resp.numel(), s.fraction, s.seed)]
                g = torch.Generator().manual_seed(s.seed + 1)
                tokens = out.tokens.clone()
                tokens[idx] = torch.randint(0, max(self.vocab_size, 1), (idx.numel(),), generator=g)
                out.tokens = tokens
        return out, specs


def describe(specs: list[InjectionConfig]) -> list[dict]:
    """Injections as plain dicts (for events, dumps and reports)."""
    from dataclasses import asdict

    return [asdict(s) for s in specs]


def injection_from_dict(d: dict, where: str | None = None) -> InjectionConfig:
    """An ``InjectionConfig`` from a plain dict (a dump's record); unknown keys are an error."""
    from dataclasses import fields

    names = {f.name for f in fields(InjectionConfig)}
    bad = sorted(set(d) - names)
    if bad:
        raise InjectionError(
            f"{where or 'injection'}: unknown key {bad[0]}; allowed: {', '.join(sorted(names))}"
        )
    return InjectionConfig(**d)
