"""Agon: rewards and per-model advantages equal reference/gradients.py: agon_step; the loss and its
logits gradient on Agon's advantages equal the reference under TP 1 and 2, micro-batch and DP
splits; the zero-sum identity, γ = 0 as two independent GRPO learners, balanced role alternation;
the two models' updates never touch each other (two tiny Megatron learners); B resumes bit for
bit from its sharded checkpoint."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.gradients as rg
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.methods.gradients.agon import (
    AgonKnobs,
    agon_rewards,
    drafter,
    reader_text,
    step_prompts,
)
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.testing.equivalence import megarl_loss_and_grad, reference_loss_and_grad
from tests.methods.helpers import load_example
from tests.property.strategies import rl_cases

GRPO = ADVANTAGE_ESTIMATORS.get("grpo")


def _correctness(b, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 2, (b.num_seqs,), generator=g).double(),
        torch.randint(0, 2, (b.num_seqs,), generator=g).double(),
    )


def _example_cases():
    cfg = ObjectiveConfig(**load_example("agon")["objective"])
    return rl_cases(torch.float64, cfgs=st.just(cfg), min_groups=2)


@settings(max_examples=8, deadline=None)
@given(_example_cases(), st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.5, 1.0]), st.booleans())
def test_rewards_and_advantages_equal_the_reference(case, seed, gamma, reader_side):
    b = case.batch
    c_d, c_a = _correctness(b, seed)
    r_d, r_s = agon_rewards(c_d, c_a, gamma)
    want_rd, want_rs, want_ad, want_as = rg.agon_step(c_d, c_a, b.group_ids, gamma)
    torch.testing.assert_close(r_d, want_rd, rtol=0, atol=1e-12)
    torch.testing.assert_close(r_s, want_rs, rtol=0, atol=1e-12)
    b.rewards = r_s if reader_side else r_d
    got = GRPO(b)
    want = (want_as if reader_side else want_ad)[b.seq_index()] * b.loss_mask.double()
    torch.testing.assert_close(got.double() * b.loss_mask.double(), want, rtol=1e-10, atol=1e-10)


@settings(max_examples=6, deadline=None)
@given(
    _example_cases(),
    st.integers(0, 2**31 - 1),
    st.sampled_from([(1, 1, 1), (2, 1, 2), (1, 2, 3), (2, 2, 1)]),
)
def test_loss_and_gradient_on_agon_advantages_equal_the_reference(case, seed, split):
    """Each model's update: the example's objective on its own GRPO advantages of Agon rewards."""
    b = case.batch
    c_d, c_a = _correctness(b, seed)
    r_d, _ = agon_rewards(c_d, c_a, 1.0)
    b.rewards = r_d
    b.advantages = (GRPO(b).double() * b.loss_mask.double()).to(b.advantages.dtype)
    want_adv = rg.agon_step(c_d, c_a, b.group_ids, 1.0)[2][b.seq_index()] * b.loss_mask.double()
    ref_case = dataclasses.replace(case, batch=dataclasses.replace(b, advantages=want_adv))
    tp, dp, mb = split
    loss, grad = megarl_loss_and_grad(case, tp=tp, dp=dp, micro_batches=min(mb, b.num_seqs))
    ref_loss, ref_grad = reference_loss_and_grad(ref_case)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-10)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=8), st.floats(0, 3), st.integers(0, 99))
def test_zero_sum_identity_and_gamma_zero_is_independent_grpo(c, gamma, seed):
    c_d = torch.tensor(c, dtype=torch.float64)
    c_a = c_d[torch.randperm(len(c), generator=torch.Generator().manual_seed(seed))]
    r_d, r_s = agon_rewards(c_d, c_a, gamma)
    assert torch.allclose((r_d - c_d) + (r_s - c_a), torch.zeros_like(c_d), atol=1e-12)
    r_d0, r_s0 = agon_rewards(c_d, c_a, 0.0)  # γ = 0: each model's reward is its own correctness
    assert torch.equal(r_d0, c_d) and torch.equal(r_s0, c_a)


def test_roles_alternate_balanced_and_prompts_are_a_function_of_the_step():
    roles = [drafter(s) for s in range(1, 41)]
    assert roles.count("a") == roles.count("b") == 20
    assert all(roles[i] != roles[i + 1] for i in range(39))
    assert step_prompts(50, 7, 3, 6) == step_prompts(50, 7, 3, 6) != step_prompts(50, 7, 4, 6)
    assert reader_text("{draft} {prompt}", "12345", "R321=", 3) == "123 R321="


def test_knobs_are_checked_and_the_example_loads():
    with pytest.raises(ValueError, match="method.gamma"):
        AgonKnobs(gamma=-1).check()
    with pytest.raises(ValueError, match=r"must contain \{draft\}"):
        AgonKnobs(reader_template="{prompt}").check()
    with pytest.raises(ValueError, match="method.second_init"):
        AgonKnobs(second_init="/nonexistent").check()
    cfg = load_example("agon")
    assert cfg["method"]["name"] == "agon"


def _tiny(seed: int = 1):
    from megarl.learner.factory import build_learner
    from megarl.learner.optim_config import OptimConfig
    from tests.methods.teacher_cases import tiny_learner_setup

    hf, groups = tiny_learner_setup(24)
    optim = OptimConfig(lr=1e-2)

    def make_learner(h, weights_dir, trainable=False):  # both models start from the same seed
        return build_learner(h, groups, optim, "float32", seed, trainable=trainable)

    return hf, groups, make_learner


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_two_models_never_touch_each_other():
    """B's optimizer steps leave A bit for bit, and A's leave B (two learners, two optimizers)."""
    from types import SimpleNamespace as NS

    from megarl.batch import from_sequences
    from megarl.methods.gradients.agon import Agon
    from megarl.objectives.api import GlobalNormalisers
    from megarl.objectives.rl_objective import build_objective

    hf, groups, make_learner = _tiny()
    cfg = NS(
        objective=ObjectiveConfig(policy_loss="ppo"),
        advantage=NS(estimator="grpo", knobs={}),
        schedule=NS(micro_batches=1, mini_batches=2, ppo_epochs=1, old_logprobs="recompute"),
        rollout=NS(max_new_tokens=4),
    )
    a = make_learner(hf, None, trainable=True)
    ctx = NS(
        cfg=cfg, hf_config=hf, init_dir=None, make_learner=make_learner, policy=a, groups=groups,
        dp_share=lambda b: b, dp_group=None,
    )  # fmt: skip
    agon = Agon(ctx, AgonKnobs())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 24, (3,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(4, 24, (4,), generator=g).tolist() for _ in range(8)]
    rewards = torch.tensor([1.0, 0, 2, 0, 1, 0, 0, -1])
    batch = from_sequences(prompts, responses, [0, 0, 0, 0, 1, 1, 1, 1], rewards=rewards)
    batch.rollout_logprobs = torch.zeros(batch.num_tokens)
    a0, b0 = _params(a.model), _params(agon.second.model)
    agon._second_batch = batch  # what next_batch keeps for B
    m = agon.after_step(2, {})
    a1, b1 = _params(a.model), _params(agon.second.model)
    assert _same(a0, a1) and not _same(b0, b1) and m["agon/b_optimizer_steps"] == 2.0, m
    batch.old_logprobs = a.compute_logprobs(batch)[0]
    batch.advantages = torch.linspace(-1, 1, batch.num_tokens) * batch.loss_mask
    a.train_step(batch, build_objective(cfg.objective), 1, GlobalNormalisers.from_batch(batch))
    assert _same(b1, _params(agon.second.model)) and not _same(a1, _params(a.model))


def _agon_with_b(seed: int = 1):
    """An Agon part whose B is a tiny Megatron learner, as a run builds it (A is not needed here)."""
    from types import SimpleNamespace as NS

    from megarl.methods.gradients.agon import Agon

    hf, groups, make_learner = _tiny(seed)
    cfg = NS(
        objective=ObjectiveConfig(policy_loss="ppo"),
        advantage=NS(estimator="grpo", knobs={}),
        schedule=NS(micro_batches=1, mini_batches=2, ppo_epochs=1, old_logprobs="recompute"),
        rollout=NS(max_new_tokens=4),
    )
    ctx = NS(
        cfg=cfg, hf_config=hf, init_dir=None, make_learner=make_learner, policy=None, groups=groups,
        dp_share=lambda b: b, dp_group=None,
    )  # fmt: skip
    return Agon(ctx, AgonKnobs())


def _b_batch(step: int):
    """B's outputs of ``step`` (a fresh batch: B's step writes its inputs into it)."""
    from megarl.batch import from_sequences

    g = torch.Generator().manual_seed(step)
    prompts = [torch.randint(4, 24, (3,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(4, 24, (4,), generator=g).tolist() for _ in range(8)]
    rewards = torch.randint(0, 3, (8,), generator=g).double()
    batch = from_sequences(prompts, responses, [0, 0, 0, 0, 1, 1, 1, 1], rewards=rewards)
    batch.rollout_logprobs = -torch.rand(batch.num_tokens, generator=g)
    return batch


def test_second_model_resumes_bit_exact(tmp_path):
    """B checkpointed after step 1 (model, Adam moments, LR schedule: ``save_sharded``) and loaded into
    a fresh part redoes step 2 bit for bit: the same metrics and the same B weights."""
    agon = _agon_with_b(seed=1)
    agon._second_batch = _b_batch(1)  # what next_batch keeps for B
    agon.after_step(1, {})
    agon.save_sharded(tmp_path / "hook_0")
    agon._second_batch = _b_batch(2)
    straight = agon.after_step(2, {})
    resumed = _agon_with_b(seed=2)  # other initial weights: everything must come from the checkpoint
    before = _params(resumed.second.model)
    resumed.load_sharded(tmp_path / "hook_0")
    assert not _same(before, _params(resumed.second.model))
    resumed._second_batch = _b_batch(2)
    again = resumed.after_step(2, {})
    assert again == straight and straight["agon/b_optimizer_steps"] == 2.0, (straight, again)
    assert _same(_params(agon.second.model), _params(resumed.second.model))
    assert resumed.second.scheduler.num_steps == agon.second.scheduler.num_steps == 4
