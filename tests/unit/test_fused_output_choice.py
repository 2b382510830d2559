"""Which objectives the learner may run from the fused output layer's per-token statistics, and that
an objective given those statistics (logits None) computes what it computes from the logits."""

import dataclasses

import pytest
import torch

from megarl.batch import PackedBatch
from megarl.catalogue import load_builtin
from megarl.learner.fused_output import FusedHead, objective_reason
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.rl_objective import ObjectiveConfig, RLObjective
from megarl.ops.vocab_parallel import vocab_parallel_logprobs_entropy
from megarl.registry import PartInfo
from megarl.trainer.warmup import SFTObjective


def test_objectives_that_read_logits_keep_them():
    load_builtin()
    assert objective_reason(RLObjective(ObjectiveConfig(policy_loss="ppo", entropy_coef=0.01))) is None
    assert objective_reason(SFTObjective()) is None
    sampled = ObjectiveConfig(distill="sampled_reverse_kl", distill_coef=0.1)
    assert objective_reason(RLObjective(sampled)) is None
    full = RLObjective(ObjectiveConfig(distill="forward_kl", distill_coef=0.1))
    assert "reads the full logits" in objective_reason(full)
    # a regulariser that does not declare reads_logits=False keeps the logits (the safe default)
    assert PartInfo().reads_logits
    reg = RLObjective(ObjectiveConfig(regularisers=[{"name": "cokl", "coef": 0.1}]))
    assert "reads the full logits" in objective_reason(reg)

    class Custom:
        def __call__(self, logits, batch, ctx): ...

    assert "defines no accepts_token_stats" in objective_reason(Custom())


def test_bad_mode_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="fused_output='yes'; allowed: auto, on, off"):
        FusedHead(torch.nn.Linear(1, 1), None, "yes", None)


def test_rl_objective_from_token_stats_equals_from_logits():
    g = torch.Generator().manual_seed(0)
    T, V = 11, 7
    cu = torch.tensor([0, 5, 11])
    mask = torch.ones(T)
    mask[[0, 1, 5, 6]] = 0
    batch = PackedBatch(
        tokens=torch.randint(0, V, (T,), generator=g),
        cu_seqlens=cu,
        prompt_lens=torch.tensor([2, 2]),
        loss_mask=mask,
        group_ids=torch.tensor([0, 0]),
        advantages=torch.randn(T, generator=g),
        old_logprobs=-torch.rand(T, generator=g),
        ref_logprobs=-torch.rand(T, generator=g),
    ).validate()
    ctx = LossContext(normalisers=GlobalNormalisers.from_batch(batch))
    obj = RLObjective(ObjectiveConfig(policy_loss="ppo", kl_coef=0.1, entropy_coef=0.02))
    logits = torch.randn(T, V, generator=g, dtype=torch.float64)
    a = logits.clone().requires_grad_()
    out_a = obj(a, batch, ctx)
    out_a.loss.backward()
    b = logits.clone().requires_grad_()
    stats = vocab_parallel_logprobs_entropy(b, batch.tokens)
    out_b = obj(None, batch, dataclasses.replace(ctx, token_stats=stats))
    out_b.loss.backward()
    assert torch.equal(out_a.loss, out_b.loss)
    assert torch.equal(a.grad, b.grad)
    assert out_a.metrics.keys() == out_b.metrics.keys()
