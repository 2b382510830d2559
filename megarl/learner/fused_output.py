"""The training forward without ``[T, V]`` logits: megatron's output layer fused with the per-token
logprob/entropy op (megarl.ops.fused_output).

While ``FusedHead.hidden_out()`` is active, the GPTModel's output layer returns its input (the final
hidden states, after the final norm) instead of logits and records the weight the model passed it
(the output layer's own, or the shared embedding weight with tied embeddings, on any pipeline
stage that computes the output). ``token_stats`` then gathers the sequence-parallel shards (megatron's
all-gather, whose backward is the reduce-scatter the output layer would do), shifts the hidden
states to the batch's alignment exactly as ``align_logits`` shifts logits (a zero row gives the
zero logits of a sequence's first token) and calls the fused op with the TP group.

``LearnerConfig.fused_output``: ``auto`` fuses wherever the result equals the unfused path (the
objective reads only per-token logprobs and entropies, the output layer is a plain vocab-parallel
linear layer nobody hooks); ``on`` refuses, naming the reason, where it cannot; ``off`` never fuses.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

MODES = ("auto", "on", "off")


def objective_reason(objective: Any) -> str | None:
    """Why ``objective`` needs full logits (None: it runs from per-token statistics). An objective
    opts in with ``accepts_token_stats() -> bool`` (see megarl/objectives/api.py)."""
    accepts = getattr(objective, "accepts_token_stats", None)
    if accepts is None:
        return f"objective {type(objective).__name__} reads the logits (it defines no accepts_token_stats)"
    if not accepts():
        return f"objective {type(objective).__name__} reads the full logits in this configuration"
    return None


class _OutputBypass:
    """Replaces the output layer's forward: while ``active``, returns ``(input, None)`` and records
    the weight it was given."""

    def __init__(self, layer: torch.nn.Module):
        self.layer, self.original = layer, layer.forward
        self.active = False
        self.weight: torch.Tensor | None = None

    def __call__(self, input_, weight=None, runtime_gather_output=None):
        if not self.active:
            return self.original(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        self.weight = self.layer.weight if weight is None else weight
        return input_, None


class FusedHead:
    """One learner's fused output layer: the decision per objective, the swap, the statistics."""

    def __init__(self, model: torch.nn.Module, groups: Any, mode: str, chunk_tokens: int | None):
        if mode not in MODES:
            raise ValueError(f"fused_output={mode!r}; allowed: {', '.join(MODES)}")
        self.model, self.groups, self.mode, self.chunk_tokens = model, groups, mode, chunk_tokens
        self._bypass: _OutputBypass | None = None

    def model_reason(self) -> str | None:
        """Why this model's output layer cannot be fused (None: it can)."""
        from megatron.core.tensor_parallel import ColumnParallelLinear

        m = self.model
        if not getattr(m, "post_process", False):
            return None  # no output layer on this stage: nothing to fuse, nothing to refuse
        layer = getattr(m, "output_layer", None)
        if type(layer) is not ColumnParallelLinear:
            return f"the output layer is a {type(layer).__name__}, not megatron's ColumnParallelLinear"
        if getattr(self.groups.layout, "cp", 1) > 1:
            # each CP rank scores the whole gathered row: fused, every rank would add the whole
            # row's weight gradient (unfused, only its own tokens' logits reach the weight)
            return "context parallelism gathers the packed row's logits after the output layer"
        if getattr(m, "mtp_process", False):
            return "multi-token prediction reads the output layer several times"
        if layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks:
            return "a hook observes the output layer's logits"
        if layer.bias is not None or layer.gather_output or layer.explicit_expert_comm:
            return "the output layer has a bias, gathers its output or is an expert layer"
        if m.config.defer_embedding_wgrad_compute:
            return "defer_embedding_wgrad_compute keeps the output layer's activations"
        return None

    def enabled(self, objective: Any = None) -> bool:
        """Fuse for ``objective`` (None: a logprob pass)? ``on`` raises naming the reason it cannot."""
        if self.mode == "off":
            return False
        reason = self.model_reason() or (objective_reason(objective) if objective is not None else None)
        if reason is not None and self.mode == "on":
            raise ValueError(f"fused_output=on: {reason}; set fused_output: auto or off")
        return reason is None

    @contextlib.contextmanager
    def hidden_out(self, active: bool):
        """While active, the model returns the output layer's input ``[1, T(/tp), H]``."""
        if not active or not getattr(self.model, "post_process", False):
            yield
            return
        if self._bypass is None:
            self._bypass = _OutputBypass(self.model.output_layer)
            self.model.output_layer.forward = self._bypass
        self._bypass.active = True
        try:
            yield
        finally:
            self._bypass.active = False

    def _aligned(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, Any, bool]:
        """(hidden states aligned like ``align_logits`` [T, H], TP group, whether the op sums the
        hidden gradient over TP) from the last stage's ``[T_pad(/tp), H]``."""
        from megarl.learner.forward import align_logits

        if self._bypass is None or self._bypass.weight is None:
            raise RuntimeError("the fused output layer was used before a forward inside hidden_out(True)")
        g = self.groups
        reduce_here = True
        if g.layout.tp > 1 and g.layout.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=True, group=g.tp
            )
            reduce_here = False  # the gather's backward reduce-scatters the ranks' parts
        return align_logits(hidden, cu_seqlens), (g.tp if g.layout.tp > 1 else None), reduce_here

    def token_stats(
        self, hidden: torch.Tensor, tokens: torch.Tensor, cu_seqlens: torch.Tensor, with_entropy: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs [T], entropy [T]) of ``tokens`` from the last stage's hidden states ``[T_pad(/tp), H]``
        (what the model returned inside ``hidden_out``), aligned like ``align_logits``."""
        from megarl.ops.fused_output import fused_logprobs_entropy

        aligned, tp_group, reduce_here = self._aligned(hidden, cu_seqlens)
        assert self._bypass is not None and self._bypass.weight is not None
        return fused_logprobs_entropy(
            aligned,
            self._bypass.weight,
            tokens.to(aligned.device),
            tp_group,
            self.chunk_tokens,
            with_entropy=with_entropy,
            reduce_hidden_grad=reduce_here,
        )

    def topk_logprobs(
        self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [T, k], logprobs [T, k]) of the k most likely tokens at every aligned position."""
        from megarl.ops.fused_output import fused_topk_logprobs

        aligned, tp_group, _ = self._aligned(hidden, cu_seqlens)
        assert self._bypass is not None and self._bypass.weight is not None
        return fused_topk_logprobs(aligned, self._bypass.weight, k, tp_group, self.chunk_tokens)
