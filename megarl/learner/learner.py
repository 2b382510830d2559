"""The Megatron learner: model + DDP + DistributedOptimizer + LR schedule, driven by packed batches.

Every rank of a model replica (its TP/PP/EP peers) must be given the same ``PackedBatch``; data-parallel
replicas get different ones. Micro-batches are whole-sequence slices of that batch
(``PackedBatch.split``), run through megatron's ``get_forward_backward_func`` (1F1B with PP).

Loss scaling, explicitly (see docs/learner.md):
- ``Objective`` losses are already globally normalised (``GlobalNormalisers.from_batch(batch, dp)``):
  the sum over micro-batches and DP ranks *is* the global loss. So the model config sets
  ``calculate_per_token_loss=True``, which makes megatron's schedule skip its division by the number of
  micro-batches and makes megatron DDP reduce gradients with SUM (gradient_scaling_factor 1).
  ``finalize_model_grads`` is called with ``num_tokens=None`` so it does not rescale either.
- MoE auxiliary losses are per micro-batch means; megatron backpropagates them with
  ``grad_scale_func(1)``. We set ``grad_scale_func(t) = t * s`` with ``s = 1 / (M * dp)`` so their
  summed gradient is the mean over micro-batches and replicas, and the objective loss handed to the
  schedule is ``loss / s`` so that its own gradient stays exactly ``d loss``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from megarl.batch import PackedBatch
from megarl.learner.forward import align_logits, packed_inputs, run_model, unwrap
from megarl.learner.fused_output import FusedHead
from megarl.learner.heads import align_head, attach_heads, check_heads, head_outputs
from megarl.learner.model import build_gpt_model, load_hf_config
from megarl.learner.optim_config import OptimConfig
from megarl.learner.parallel import ParallelGroups
from megarl.objectives.api import (
    GlobalNormalisers,
    LossContext,
    Objective,
    micro_batch_context,
    step_normalisers,
)


@runtime_checkable
class OptimizerHook(Protocol):
    """Acts around each optimizer step of a learner: sees the reduced gradients before it and the
    updated weights after it (``ok``: the step was taken; False when it was skipped)."""

    def before_optimizer_step(self, learner: Learner) -> None: ...

    def after_optimizer_step(self, learner: Learner, ok: bool) -> None: ...


@dataclass
class LearnerConfig:
    """What builds a learner: the HF config, dtype, optimizer and numerics knobs."""

    hf_config: Any  # dict, config.json path or model directory
    optim: OptimConfig = field(default_factory=OptimConfig)
    params_dtype: torch.dtype = torch.float32
    chunk_tokens: int | None = (
        None  # token chunk of the vocab-parallel ops; None: the ops pick ~2**24 elements
    )
    moe_aux_loss_coeff: float | None = None  # None = from the HF config (router_aux_loss_coef)
    moe_routing_replay: bool = False  # R3: train_step replays batch.routed_experts (see record_routes)
    seed: int = 1234
    # False: a forward-only learner (KL reference, teacher): parameters frozen, no gradient buffers,
    # no optimizer state or scheduler; train_step refuses
    trainable: bool = True
    # the output layer fused with the logprob/entropy op (megarl/learner/fused_output.py): 'auto'
    # where the objective reads only per-token statistics, 'on' (refuse where it cannot), 'off'
    fused_output: str = "auto"
    # extra scalar output heads on the trunk's final hidden states (megarl/learner/heads.py): trained
    # by the objective through ``LossContext.heads`` in the same backward, held by the optimizer
    # and checkpoints, left out of HF export
    heads: tuple[str, ...] = ()


class Learner:
    """One rank's part of the learner. All public methods are collective over the world."""

    def __init__(
        self,
        cfg: LearnerConfig,
        groups: ParallelGroups,
        perform_initialization: bool = True,
        before_wrap: Callable[[torch.nn.Module], None] | None = None,
    ):
        """``before_wrap(model)`` may change the bare model before DDP and the optimizer see its
        parameters (e.g. load weights and swap the output layer: megarl.learner.value_model)."""
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from megarl.learner.ddp import WeakHookDDP
        from megarl.learner.shard_views import retain_grad_on_shard_views

        self.cfg, self.groups = cfg, groups
        self.hf_config = load_hf_config(cfg.hf_config)
        torch.manual_seed(cfg.seed)
        model = build_gpt_model(
            self.hf_config,
            groups,
            params_dtype=cfg.params_dtype,
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            perform_initialization=perform_initialization,
            routing_replay=cfg.moe_routing_replay,
        )
        if before_wrap is not None:
            before_wrap(model)
        check_heads(tuple(cfg.heads), groups.layout, cfg.trainable)
        attach_heads(model, tuple(cfg.heads), groups, cfg.params_dtype)
        self.spec = model.megarl_spec
        self.fused = FusedHead(model, groups, cfg.fused_output, cfg.chunk_tokens)
        self.config = model.config
        self.config.calculate_per_token_loss = True
        o = cfg.optim
        if not cfg.trainable:
            for p in model.parameters():
                p.requires_grad_(False)  # DDP allocates gradient buffers only for trainable parameters
        self.ddp = WeakHookDDP(
            self.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=o.use_distributed_optimizer,
                average_in_collective=False,
            ),
            model,
        )
        self.ddp.megarl_spec = self.spec
        self.config.no_sync_func = self.ddp.no_sync
        self.config.finalize_model_grads_func = self._finalize_grads
        self.step = 0
        # parts that act around every optimizer step (e.g. a projection of the update)
        self.optimizer_hooks: list[OptimizerHook] = []
        self.optimizer = self.scheduler = None
        if not cfg.trainable:
            return
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                min_lr=o.min_lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1,
                adam_beta2=o.adam_beta2,
                adam_eps=o.adam_eps,
                clip_grad=o.clip_grad,
                use_distributed_optimizer=o.use_distributed_optimizer,
                bf16=cfg.params_dtype == torch.bfloat16,
                params_dtype=cfg.params_dtype,
            ),
            [self.ddp],
            use_gloo_process_groups=False,
        )
        retain_grad_on_shard_views(self.optimizer)
        shims = sys.modules.get("megarl.learner.cpu_shims")
        if shims is not None and shims.shims_applied():
            shims.inner_steps_without_device_mode(self.optimizer)
        decay = max(o.lr_decay_steps, o.lr_warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if o.lr_warmup_steps else o.lr,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps,
            lr_decay_steps=decay,
            lr_decay_style=o.lr_decay_style if o.lr_decay_steps else "constant",
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )

    # ------------------------------------------------------------------------- weights
    @property
    def model(self) -> torch.nn.Module:
        """The bare GPTModel (this rank's stage)."""
        return unwrap(self.ddp)

    def load_hf(self, source) -> None:
        """Load HF weights (directory or dict) into the model and the optimizer's fp32 copies."""
        from megarl.convert.hf_megatron import load_hf_into_model

        load_hf_into_model(self.model, self.groups, source)
        self._sync_main_params()

    def add_optimizer_hook(self, hook: OptimizerHook) -> None:
        """Call ``hook.before_optimizer_step(self)`` and ``hook.after_optimizer_step(self, ok)``
        around every optimizer step of ``train_step`` (every rank; collective if the hook is)."""
        self.optimizer_hooks.append(hook)

    def sync_main_params(self) -> None:
        """After writing the model's weights in place, refresh the optimizer's main copies."""
        self._sync_main_params()

    def _sync_main_params(self) -> None:
        # The optimizer keeps its own fp32 copy (bf16 runs) or a shard view (DistributedOptimizer);
        # after writing weights into the model, reload them from the model.
        if self.optimizer is None:
            return
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if hasattr(opt, "reload_model_params"):
                opt.reload_model_params()

    # ------------------------------------------------------------------------- helpers
    def _pad_multiple(self) -> int:
        return self.groups.layout.tp if self.groups.layout.sequence_parallel else 1

    def require_whole_rows(self, what: str) -> None:
        """Refuse ``what`` (a reader of per-token activations inside the model: hooks on layers)
        under context parallelism, where each rank's layers see only its share of the row."""
        if self.groups.layout.cp > 1:
            raise ValueError(
                f"{what} reads per-token activations of the whole packed row inside the model; "
                f"it does not support context parallelism (parallel.cp={self.groups.layout.cp}): use cp=1"
            )

    def _cp_group(self):
        return self.groups.cp if self.groups.layout.cp > 1 else None

    def _finalize_grads(self, model_chunks, num_tokens=None, **kwargs) -> None:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(model_chunks, num_tokens=None)  # never rescale: losses are global already

    def _run_schedule(
        self,
        micro_batches: list[PackedBatch],
        loss_func,
        forward_only: bool,
        routing: str | None = None,
        recorded: list | None = None,
        with_heads: bool = False,
        fused: bool = False,
    ) -> list:
        """Micro-batches through megatron's schedule. ``routing``: None, 'record' (append each
        micro-batch's local routes to ``recorded``) or 'replay' (use ``mb.routed_experts``).
        ``with_heads``: ``loss_func(mb, heads, output)`` also gets the output heads' outputs of the
        micro-batch (``{name: [T]}`` aligned, with their graph; {} without heads)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megarl.learner import routing_replay as rr

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            inputs = packed_inputs(
                mb.tokens, mb.cu_seqlens, self.groups.device, self._pad_multiple(), cp_group=self._cp_group()
            )
            if routing == "replay":
                rr.set_replay_targets(self.model, mb.routed_experts, inputs.input_ids.shape[1], self.groups)
            with self.fused.hidden_out(fused):  # fused: the last stage returns hidden states
                out = run_model(model, inputs)
            if routing == "record":
                recorded.append(rr.collect_local(self.model))
            if with_heads:
                heads = {k: align_head(v, mb.cu_seqlens) for k, v in head_outputs(self.model).items()}
                return out, partial(loss_func, mb, heads)
            head_outputs(self.model)  # forget them
            return out, partial(loss_func, mb)

        if routing is not None:
            if self.groups.layout.cp > 1:
                raise ValueError(
                    "routing record/replay is per token of the packed row; it does not support "
                    f"context parallelism (parallel.cp={self.groups.layout.cp})"
                )
            rr.set_action(self.model, routing)

        fb = get_forward_backward_func()
        max_len = max(mb.num_tokens for mb in micro_batches)
        max_len = -(-max_len // self._pad_multiple()) * self._pad_multiple()
        try:
            return fb(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=[self.ddp],
                num_microbatches=len(micro_batches),
                seq_length=max_len,
                micro_batch_size=1,
                forward_only=forward_only,
            )
        finally:
            if routing is not None:
                rr.set_action(self.model, None)

    def _loss_inputs(self, out: torch.Tensor, mb: PackedBatch, ctx: LossContext, fused: bool):
        """(aligned logits, ctx) for the objective from the last stage's output; fused: (None, ctx
        with ``token_stats`` from the hidden states)."""
        if not fused:
            return align_logits(out, mb.cu_seqlens), ctx
        return None, replace(ctx, token_stats=self.fused.token_stats(out, mb.tokens, mb.cu_seqlens))

    def _from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        """Broadcast a tensor of known shape from the last pipeline stage to every stage."""
        if self.groups.layout.pp > 1:
            src = dist.get_global_rank(self.groups.pp, self.groups.layout.pp - 1)
            dist.broadcast(t, src=src, group=self.groups.pp)
        return t

    # ------------------------------------------------------------------------- forward only
    @torch.no_grad()
    def compute_logprobs(
        self, batch: PackedBatch, num_micro_batches: int = 1, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token logprobs ``[T]`` (and entropies ``[T]`` when asked) of ``batch.tokens`` under the
        current weights, aligned to the batch convention (first token of each sequence: 0).

        Logits stay vocab-parallel: megarl.ops.vocab_parallel, never a gathered ``[T, V]``.
        Returned on every rank.
        """
        from megarl.ops.vocab_parallel import vocab_parallel_logprobs_entropy

        self.ddp.eval()
        tp_group = self.groups.tp if self.groups.layout.tp > 1 else None

        fused = self.fused.enabled()

        def loss_func(mb: PackedBatch, logits: torch.Tensor):
            if fused:
                lp, ent = self.fused.token_stats(logits, mb.tokens, mb.cu_seqlens, with_entropy=with_entropy)
            else:
                aligned = align_logits(logits, mb.cu_seqlens)
                lp, ent = vocab_parallel_logprobs_entropy(
                    aligned, mb.tokens.to(aligned.device), tp_group, self.cfg.chunk_tokens, with_entropy
                )
            first = mb.cu_seqlens[:-1]
            lp[first] = 0.0
            ent[first] = 0.0
            zero = logits.new_zeros(())
            return zero, torch.tensor(1, dtype=torch.int), {"logprobs": lp, "entropy": ent}

        micro = batch.split(num_micro_batches)
        out = self._run_schedule(micro, loss_func, forward_only=True, fused=fused)
        T = batch.num_tokens
        lp = torch.zeros(T, dtype=torch.float32, device=self.groups.device)
        ent = torch.zeros(T, dtype=torch.float32, device=self.groups.device)
        if self.groups.is_last_stage:
            lp = torch.cat([d["logprobs"].float() for d in out])
            ent = torch.cat([d["entropy"].float() for d in out])
        lp = self._from_last_stage(lp)
        ent = self._from_last_stage(ent)
        self.ddp.train()
        return lp.cpu(), (ent.cpu() if with_entropy else None)

    @torch.no_grad()
    def compute_logits(self, batch: PackedBatch, num_micro_batches: int = 1) -> torch.Tensor | None:
        """This rank's vocab shard of the aligned logits ``[T, V/tp]`` of ``batch`` (``logits[t]``
        scored ``tokens[t]``; rows of first tokens are the model's, unused), on the last pipeline
        stage; None on the other stages. They stay on the learner's device."""
        self.ddp.eval()
        micro = batch.split(num_micro_batches)

        def loss_func(mb: PackedBatch, logits: torch.Tensor):
            aligned = align_logits(logits, mb.cu_seqlens)
            return logits.new_zeros(()), torch.tensor(1, dtype=torch.int), {"logits": aligned}

        try:
            out = self._run_schedule(micro, loss_func, forward_only=True)
        finally:
            self.ddp.train()
        if not self.groups.is_last_stage:
            return None
        return torch.cat([d["logits"] for d in out])

    @torch.no_grad()
    def compute_topk_logprobs(
        self, batch: PackedBatch, k: int, num_micro_batches: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids [T, k] int64 global ids, logprobs [T, k] fp32) of the k most likely tokens at every
        position of ``batch``, aligned like ``compute_logits`` (rows of first tokens unused), best
        first, on the last pipeline stage (None elsewhere). With the fused output layer
        (``fused_output``) no ``[T, V/tp]`` logits exist; else a vocab-parallel top-K of the logits."""
        from megarl.ops.vocab_parallel import vocab_parallel_logsumexp, vocab_parallel_topk

        fused = self.fused.enabled()
        tp_group = self.groups.tp if self.groups.layout.tp > 1 else None

        def loss_func(mb: PackedBatch, out: torch.Tensor):
            if fused:
                ids, lp = self.fused.topk_logprobs(out, mb.cu_seqlens, k)
            else:
                aligned = align_logits(out, mb.cu_seqlens)
                vals, ids = vocab_parallel_topk(aligned, k, tp_group)
                lse = vocab_parallel_logsumexp(aligned.float(), tp_group, self.cfg.chunk_tokens)
                lp = vals.float() - lse.unsqueeze(-1)
            return out.new_zeros(()), torch.tensor(1, dtype=torch.int), {"ids": ids, "lp": lp.float()}

        self.ddp.eval()
        try:
            out = self._run_schedule(
                batch.split(num_micro_batches), loss_func, forward_only=True, fused=fused
            )
        finally:
            self.ddp.train()
        if not self.groups.is_last_stage:
            return None
        return torch.cat([d["ids"] for d in out]), torch.cat([d["lp"] for d in out])

    @torch.no_grad()
    def compute_head(self, batch: PackedBatch, name: str, num_micro_batches: int = 1) -> torch.Tensor:
        """Output head ``name``'s values ``[T]`` (float32, every rank) of ``batch`` under the current
        weights, aligned like ``compute_logprobs`` (first token of each sequence: 0). Collective."""
        if name not in self.cfg.heads:
            raise ValueError(
                f"compute_head: the learner has no output head {name!r} (heads: {list(self.cfg.heads)})"
            )

        def loss_func(mb: PackedBatch, heads: dict, logits: torch.Tensor):
            return logits.new_zeros(()), torch.tensor(1, dtype=torch.int), {"v": heads[name]}

        self.ddp.eval()
        try:
            out = self._run_schedule(
                batch.split(num_micro_batches), loss_func, forward_only=True, with_heads=True
            )
        finally:
            self.ddp.train()
        values = torch.zeros(batch.num_tokens, dtype=torch.float32, device=self.groups.device)
        if self.groups.is_last_stage:
            values = torch.cat([d["v"].float() for d in out])
        return self._from_last_stage(values).cpu()

    @torch.no_grad()
    def record_routes(self, batch: PackedBatch, num_micro_batches: int = 1) -> torch.Tensor:
        """R3 recording: the experts every token is routed to under the current weights,
        ``[T, n_moe_layers, topk]`` int64 on every rank (store it as ``batch.routed_experts``).
        Use it when the rollout engine did not return routes (else take the engine's)."""
        from megarl.learner import routing_replay as rr

        if not self.spec.is_moe:
            raise rr.RoutingReplayError("record_routes: the model has no MoE layer")
        micro = batch.split(num_micro_batches)
        recorded: list = []

        def loss_func(mb, logits):
            return logits.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

        self.ddp.eval()
        try:
            self._run_schedule(micro, loss_func, forward_only=True, routing="record", recorded=recorded)
        finally:
            self.ddp.train()
        return rr.assemble(
            recorded,
            [mb.num_tokens for mb in micro],
            len(self.spec.moe_layers),
            self.spec.moe_topk,
            self.groups,
        )

    # ------------------------------------------------------------------------- training
    def backward_pass(
        self,
        batch: PackedBatch,
        objective: Objective,
        num_micro_batches: int = 1,
        normalisers: GlobalNormalisers | None = None,
        aux_losses: bool = False,
    ) -> None:
        """Forward and backward of ``objective`` on this rank's ``batch`` without an optimizer step,
        for parts that observe the backward (e.g. per-sequence gradient sketches from module hooks).

        Gradients land unscaled and unreduced (no data-parallel reduction) in the gradient buffers;
        the next ``train_step`` zeroes them. ``aux_losses=False`` switches MoE auxiliary and z-losses
        off for the pass, so every gradient comes from the objective alone.
        """
        if self.optimizer is None:
            raise RuntimeError("backward_pass on a forward-only learner (LearnerConfig.trainable=False)")
        g = self.groups
        norms = normalisers or GlobalNormalisers.from_batch(batch, g.dp if g.dp_size > 1 else None)
        ctx = LossContext(
            normalisers=norms,
            tp_group=g.tp if g.layout.tp > 1 else None,
            chunk_tokens=self.cfg.chunk_tokens,
            step=self.step,
        )

        fused = self.fused.enabled(objective)

        def loss_func(mb: PackedBatch, heads: dict, logits: torch.Tensor):
            aligned, mctx = self._loss_inputs(logits, mb, ctx, fused)
            res = objective(aligned, mb, replace(mctx, heads=heads) if heads else mctx)
            return res.loss, torch.tensor(1, dtype=torch.int), {}

        saved = (self.config.finalize_model_grads_func, self.config.moe_aux_loss_coeff)
        saved_z = self.config.moe_z_loss_coeff
        self.config.finalize_model_grads_func = None
        if not aux_losses:
            self.config.moe_aux_loss_coeff, self.config.moe_z_loss_coeff = 0.0, None
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        try:
            self._run_schedule(
                batch.split(num_micro_batches), loss_func, forward_only=False, with_heads=True, fused=fused
            )
        finally:
            self.config.finalize_model_grads_func, self.config.moe_aux_loss_coeff = saved
            self.config.moe_z_loss_coeff = saved_z

    def train_step(
        self,
        batch: PackedBatch,
        objective: Objective,
        num_micro_batches: int = 1,
        normalisers: GlobalNormalisers | None = None,
        old_from_forward: bool = False,
    ) -> dict[str, float]:
        """One optimizer step on this rank's ``batch`` (its DP shard of the global batch).

        ``old_from_forward``: the update is exactly on-policy, so the objective takes the old
        logprobs from this step's forward, detached (``LossContext.old_is_current``), instead of
        ``batch.old_logprobs`` from a second pass; the objective must declare
        ``current_old_logprobs``.

        Returns metrics (same on every rank): the objective's metric parts summed over micro-batches
        and DP ranks (so globally normalised), ``loss``, ``grad_norm``, ``grad_clipped``, ``lr``,
        ``num_micro_batches``, ``update_successful``.
        """
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        if self.optimizer is None:
            raise RuntimeError("train_step on a forward-only learner (LearnerConfig.trainable=False)")
        if old_from_forward and not getattr(objective, "current_old_logprobs", False):
            raise ValueError(
                f"old_from_forward: {type(objective).__name__} does not take old logprobs from the "
                "training forward (current_old_logprobs)"
            )
        g = self.groups
        dp_group = g.dp if g.dp_size > 1 else None
        if hasattr(objective, "prepare"):  # global-batch statistics of stateful parts (RLObjective)
            batch = objective.prepare(batch, dp_group)
        # the caller's normalisers, recounted where prepare narrowed the loss mask
        norms = step_normalisers(objective, batch, normalisers, dp_group)
        tp_group = g.tp if g.layout.tp > 1 else None
        ctx = LossContext(
            normalisers=norms,
            tp_group=tp_group,
            chunk_tokens=self.cfg.chunk_tokens,
            step=self.step,
            old_is_current=old_from_forward,
        )
        micro = batch.split(num_micro_batches)
        s = 1.0 / (len(micro) * g.dp_size)
        self.config.grad_scale_func = lambda t: t * s
        metric_names: list[str] = []

        fused = self.fused.enabled(objective)

        def loss_func(mb: PackedBatch, heads: dict, logits: torch.Tensor):
            aligned, mctx = self._loss_inputs(logits, mb, ctx, fused)
            res = objective(aligned, mb, micro_batch_context(mctx, mb, logits.device, heads))
            reported = {"loss": res.loss.detach().reshape(()).float()}
            for k, v in res.metrics.items():
                reported[k] = torch.as_tensor(v).detach().reshape(()).float()
            return res.loss / s, torch.tensor(1, dtype=torch.int), reported

        routing = None
        if self.cfg.moe_routing_replay:
            if batch.routed_experts is None:
                raise ValueError(
                    "moe_routing_replay is on but the batch has no 'routed_experts' "
                    "(record them with Learner.record_routes or take them from the engine)"
                )
            want = (len(self.spec.moe_layers), self.spec.moe_topk)
            if tuple(batch.routed_experts.shape[1:]) != want:
                raise ValueError(
                    f"batch field 'routed_experts' has shape {tuple(batch.routed_experts.shape)}, "
                    f"expected [T, {want[0]}, {want[1]}]"
                )
            routing = "replay"
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = self._run_schedule(
            micro, loss_func, forward_only=False, routing=routing, with_heads=True, fused=fused
        )
        # metrics: sum over micro-batches, then DP; then send from the last stage to all stages.
        if g.is_last_stage:
            metric_names = sorted(out[0].keys())
        names_holder = [metric_names]
        if g.layout.pp > 1:
            dist.broadcast_object_list(
                names_holder, src=dist.get_global_rank(g.pp, g.layout.pp - 1), group=g.pp
            )
        metric_names = names_holder[0]
        vec = torch.zeros(len(metric_names), dtype=torch.float64, device=g.device)
        if g.is_last_stage:
            for d in out:
                vec += torch.stack([d[k].double() for k in metric_names])
        if g.dp_size > 1:
            dist.all_reduce(vec, group=g.dp)
        vec = self._from_last_stage(vec)
        lr = float(self.optimizer.param_groups[0]["lr"])
        for hook in self.optimizer_hooks:
            hook.before_optimizer_step(self)
        ok, grad_norm, _ = self.optimizer.step()
        for hook in self.optimizer_hooks:
            hook.after_optimizer_step(self, bool(ok))
        if ok:
            self.scheduler.step(increment=1)
        self.step += 1
        clear_aux_losses_tracker()
        self.config.grad_scale_func = None
        metrics = {k: float(v) for k, v in zip(metric_names, vec.tolist())}
        gn = float(grad_norm) if grad_norm is not None else float("nan")
        metrics.update(
            grad_norm=gn,
            grad_clipped=float(gn > self.cfg.optim.clip_grad > 0),
            lr=lr,
            num_micro_batches=float(len(micro)),
            update_successful=float(bool(ok)),
        )
        if not math.isfinite(gn):
            metrics["nonfinite_grad"] = 1.0
        return metrics
