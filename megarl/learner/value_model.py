"""A critic on megatron-core: the policy's architecture with its vocabulary output replaced by a
scalar value head.

The head is a replicated ``hidden -> 1`` projection on the last pipeline stage (the trunk keeps
every TP/PP/EP layout the policy supports). Under sequence parallelism it gathers the sequence
shards first; every TP rank then holds the same values and computes the same loss, so the gather's
backward splits the gradient instead of reduce-scattering it (which would count it TP times).

``values[t]`` is aligned like ``logprobs[t]``: the value of the state *before* token ``t`` (the
hidden state at position ``t - 1``); 0 on the first token of every sequence.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.batch import PackedBatch
from megarl.learner.forward import align_logits
from megarl.learner.optim_config import OptimConfig


class ValueHead(torch.nn.Module):
    """hidden ``[s(/tp), b, H]`` -> values ``[s, b, 1]``, replicated across TP. Zero-initialised: V = 0
    before the first update, or the middle of ``bounds`` = (low, high), which squash the values into
    the reward range: V = low + (high - low) * sigmoid(raw)."""

    def __init__(
        self,
        hidden_size: int,
        sequence_parallel: bool,
        tp_group: Any,
        dtype: torch.dtype,
        bounds: tuple[float, float] | None = None,
    ):
        super().__init__()
        self.bounds = bounds
        # named weight/bias: megatron's GPTModel checkpoints its output layer under these keys
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        """The ``output_layer`` call signature of megatron's GPTModel; returns ``(values, None)``."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=self.tp_group
            )
        v = torch.nn.functional.linear(hidden, self.weight, self.bias)
        if self.bounds is not None:
            low, high = self.bounds
            v = low + (high - low) * torch.sigmoid(v)
        return v, None


def critic_hf_config(policy_hf: dict) -> dict:
    """The critic's HF config: the policy's, untied (the vocabulary output it would share is gone)."""
    return dict(policy_hf, tie_word_embeddings=False)


def _untied_weights(init_dir: str, policy_hf: dict) -> str | dict[str, torch.Tensor]:
    """HF weights for the untied critic trunk: the directory itself, or (tied checkpoints, which have
    no ``lm_head.weight``) its tensors with the embedding standing in for the discarded output."""
    if not policy_hf.get("tie_word_embeddings", False):
        return init_dir
    from megarl.convert.hf_megatron import HFSafetensorsReader

    reader = HFSafetensorsReader(init_dir)
    tensors = {n: reader.get(n) for n in reader.keys()}
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    return tensors


def build_value_learner(
    policy_hf: dict,
    groups: Any,
    optim: OptimConfig,
    init_dir: str | None,
    params_dtype: torch.dtype = torch.float32,
    seed: int = 1234,
    bounds: tuple[float, float] | None = None,
):
    """A trainable ``Learner`` whose model ends in a ``ValueHead`` (``bounds``: see there); its trunk is
    initialised from the HF checkpoint ``init_dir`` (the policy's weights, or another checkpoint of
    the same shape) when given, else randomly. Collective."""
    from megarl.convert.hf_megatron import load_hf_into_model
    from megarl.learner.learner import Learner, LearnerConfig

    hf = critic_hf_config(policy_hf)

    def swap_head(model: torch.nn.Module) -> None:
        if init_dir is not None:
            load_hf_into_model(model, groups, _untied_weights(init_dir, policy_hf))
        if model.post_process:
            tp = groups.tp if groups.layout.tp > 1 else None
            model.output_layer = ValueHead(
                model.config.hidden_size, model.config.sequence_parallel, tp, params_dtype, bounds
            )

    cfg = LearnerConfig(hf_config=hf, optim=optim, params_dtype=params_dtype, seed=seed)
    return Learner(cfg, groups, before_wrap=swap_head)


@torch.no_grad()
def compute_values(learner: Any, batch: PackedBatch, num_micro_batches: int = 1) -> torch.Tensor:
    """Per-token values ``[T]`` (float32, every rank) of a value learner, aligned to the batch
    convention (first token of each sequence: 0). Collective."""

    def loss_func(mb: PackedBatch, out: torch.Tensor):
        v = align_logits(out, mb.cu_seqlens)[:, 0]
        return out.new_zeros(()), torch.tensor(1, dtype=torch.int), {"values": v}

    learner.ddp.eval()
    try:
        outs = learner._run_schedule(batch.split(num_micro_batches), loss_func, forward_only=True)
    finally:
        learner.ddp.train()
    values = torch.zeros(batch.num_tokens, dtype=torch.float32, device=learner.groups.device)
    if learner.groups.is_last_stage:
        values = torch.cat([d["values"].float() for d in outs])
    return learner._from_last_stage(values).cpu()
