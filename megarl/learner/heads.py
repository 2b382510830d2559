"""Extra output heads on a learner's own trunk: scalar projections of the final hidden states that
train together with the language-model output through one backward.

A head named ``name`` is a replicated ``hidden -> 1`` projection (``megarl.learner.value_model.
ValueHead``: the vocabulary-parallel output is not involved; under sequence parallelism it gathers
the sequence shards and its backward splits the gradient, so every TP rank computes the same head
loss) registered as ``model.megarl_heads[name]`` on the last pipeline stage only. It reads the
decoder's output (after the final norm: exactly what the vocabulary output reads) through a forward
hook on ``model.decoder``, so the gradient of a loss on its output flows into the trunk. Its
parameters are ordinary model parameters: the learner's DDP buffers, its (distributed) optimizer
and its checkpoints hold them; HF export leaves them out (``HEADS_ATTR`` names their prefix).

Zero-initialised: every head outputs 0 before its first update.

``head_outputs(model)`` returns the outputs of the latest forward (``[T_pad]`` per head, unaligned,
with their graph) and forgets them; ``align_head(out, cu_seqlens)`` shifts them to the batch
convention (``out[t]`` read the hidden state before token ``t``; 0 on the first token of every
sequence), like ``align_logits``.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.learner.forward import align_logits

HEADS_ATTR = "megarl_heads"  # the ModuleDict's attribute on the GPTModel; its parameters' name prefix
_OUTPUTS_ATTR = "_megarl_head_outputs"


class HeadLayoutError(ValueError):
    """A head asked for under a layout or learner kind it does not support; the message names why."""


def check_heads(heads: tuple[str, ...], layout: Any, trainable: bool) -> None:
    """Refuse head names and layouts the heads do not support, naming the setting."""
    if not heads:
        return
    if len(set(heads)) != len(heads) or not all(isinstance(h, str) and h.isidentifier() for h in heads):
        raise HeadLayoutError(f"heads={list(heads)}: names must be distinct identifiers")
    if getattr(layout, "cp", 1) > 1:
        raise HeadLayoutError(
            f"heads={list(heads)} with parallel.cp={layout.cp}: an output head reads whole sequences "
            "of the final hidden states, which context parallelism splits; use parallel.cp=1"
        )
    if not trainable:
        raise HeadLayoutError(
            f"heads={list(heads)} on a forward-only learner (trainable=False): a head trains with the "
            "learner's optimizer"
        )


def attach_heads(
    model: torch.nn.Module, heads: tuple[str, ...], groups: Any, params_dtype: torch.dtype
) -> None:
    """Register ``heads`` on ``model`` (a bare GPTModel, before DDP wraps it). A no-op on stages
    other than the last one and when ``heads`` is empty."""
    if not heads or not model.post_process:
        return
    from megarl.learner.value_model import ValueHead

    tp = groups.tp if groups.layout.tp > 1 else None
    sp = bool(model.config.sequence_parallel)
    H = int(model.config.hidden_size)
    setattr(
        model,
        HEADS_ATTR,
        torch.nn.ModuleDict({h: ValueHead(H, sp, tp, params_dtype) for h in heads}),
    )

    def keep_outputs(module: torch.nn.Module, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        outs = {}
        for name, head in getattr(model, HEADS_ATTR).items():
            v, _ = head(hidden)  # [s, b=1, 1] whole sequence on every TP rank
            outs[name] = v.reshape(-1)
        setattr(model, _OUTPUTS_ATTR, outs)

    model.decoder.register_forward_hook(keep_outputs)


def head_outputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The heads' outputs ``[T_pad]`` of the latest forward of ``model`` (the bare GPTModel), with
    their graph; {} on other stages or without heads. Each forward's outputs are returned once."""
    outs = getattr(model, _OUTPUTS_ATTR, None) or {}
    if outs:
        setattr(model, _OUTPUTS_ATTR, None)
    return outs


def align_head(out: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Head outputs ``[T_pad]`` -> ``[T]`` aligned to the batch convention (see the module docstring)."""
    return align_logits(out[:, None], cu_seqlens)[:, 0]


def is_head_parameter(name: str) -> bool:
    """Whether the model parameter ``name`` belongs to an output head (not part of the HF model)."""
    return name.startswith(HEADS_ATTR + ".")
