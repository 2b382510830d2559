"""SC-GRPO: the packed estimator equals reference/self_distillation.py:sc_grpo_advantages, and the
PPO loss on its advantages equals the reference loss (gradient too) at TP 1/2 with micro-batches
and DP splits; the spec's invariants: per-sequence mean weight 1 before clipping, teacher = student
gives GRPO exactly, saturated groups give zero gradient, no gradient through the weight."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.self_distillation as ref
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import grpo, per_token
from megarl.batch import from_sequences, unpack
from megarl.methods.distillation.sc_grpo import KL, KLKnobs, SelfTeacherKL, sc_weights, token_kl
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.testing.equivalence import megarl_loss_and_grad, reference_loss_and_grad
from tests.methods.helpers import load_example
from tests.methods.test_self_teacher import TinyCausalLM, V
from tests.property.strategies import build_batch, rl_cases

KNOBS = st.fixed_dictionaries(
    {
        "direction": st.sampled_from(["reverse", "forward"]),
        "power": st.sampled_from([1.0, 0.5, 2.0]),
        "w_max": st.sampled_from([5.0, 1.5]),
        "scale_by_std": st.booleans(),
    }
)
CFGS = st.sampled_from([ObjectiveConfig("ppo", aggregation=a) for a in ("token-mean", "seq-mean-token-mean")])


def _set_up(case, data):
    b = case.batch
    b.self_teacher_logprobs = b.teacher_logprobs
    on = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b.num_seqs, max_size=b.num_seqs)))
    b.extras = {"self_teacher_on": on.double()}
    return on


def _reference_adv(b, on, knobs):
    p = unpack(b)
    t = p.per_token
    adv = ref.sc_grpo_advantages(
        b.rewards.double(),
        b.group_ids,
        t["self_teacher_logprobs"],
        t["old_logprobs"],
        p.loss_mask,
        on,
        **knobs,
    )
    return adv[p.attention_mask]


@settings(max_examples=4, deadline=None)
@given(
    rl_cases(torch.float64, cfgs=CFGS),
    KNOBS,
    st.sampled_from([(1, 1, 1), (2, 1, 2), (1, 2, 3), (2, 2, 1)]),
    st.data(),
)
def test_advantages_and_loss_match_reference_tp_dp_micro(case, knobs, layout, data):
    tp, dp, mb = layout
    on = _set_up(case, data)
    adv = ADVANTAGE_ESTIMATORS.get("sc_grpo")(case.batch, **knobs)
    want = _reference_adv(case.batch, on, knobs)
    torch.testing.assert_close(adv, want, rtol=1e-9, atol=1e-10)
    case.batch.advantages = adv
    ref_loss, ref_grad = reference_loss_and_grad(case)
    mb = min(mb, case.batch.num_seqs)
    loss, grad = megarl_loss_and_grad(case, tp=tp, dp=dp, micro_batches=mb)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_loss.abs())))
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_grad.abs().max())))


@settings(max_examples=20, deadline=None)
@given(
    rl_cases(torch.float64, cfgs=CFGS),
    st.sampled_from(["reverse", "forward"]),
    st.sampled_from([0.5, 1.0, 2.0]),
)
def test_weights_have_mean_one_and_teacher_equal_student_is_grpo(case, direction, power):
    b = case.batch
    k = token_kl(b.teacher_logprobs, b.old_logprobs, direction)
    assert bool((k >= -1e-12).all())
    on = torch.ones(b.num_seqs)
    w = sc_weights(k, b.loss_mask, b.cu_seqlens, on, power, w_max=1e9)  # no clipping
    n = b.response_lens()
    for i in range(b.num_seqs):
        s, e = int(b.cu_seqlens[i]), int(b.cu_seqlens[i + 1])
        if n[i] > 0:
            assert abs(float(w[s:e].sum()) / int(n[i]) - 1.0) < 1e-9
    b.self_teacher_logprobs = b.old_logprobs.clone()
    adv = ADVANTAGE_ESTIMATORS.get("sc_grpo")(b, direction=direction, power=power)
    assert torch.equal(adv, per_token(b, grpo(b.rewards.double(), b.group_ids)))


def test_saturated_groups_give_zero_and_no_gradient_flows_through_the_weight():
    b = from_sequences([[1]] * 4, [[2, 3]] * 4, [0, 0, 1, 1], rewards=[1.0, 1.0, 0.0, 0.0])
    b.old_logprobs = torch.full((b.num_tokens,), -1.0, dtype=torch.float64)
    b.self_teacher_logprobs = torch.full((b.num_tokens,), -0.2, dtype=torch.float64, requires_grad=True)
    adv = ADVANTAGE_ESTIMATORS.get("sc_grpo")(b)
    assert bool((adv == 0).all()) and not adv.requires_grad
    b.rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    b.self_teacher_logprobs = b.self_teacher_logprobs.detach()
    assert bool((ADVANTAGE_ESTIMATORS.get("sc_grpo")(b).abs() > 0).any())


def test_example_and_missing_inputs_are_named():
    cfg = load_example("sc-grpo")
    assert (
        cfg["advantage"]["estimator"] == "sc_grpo"
        and cfg["inputs"]["self_teacher_context"]["source"] == "sibling"
    )
    case_b = from_sequences([[1]], [[2]], [0], rewards=[1.0])
    with pytest.raises(ValueError, match="self_teacher_logprobs"):
        ADVANTAGE_ESTIMATORS.get("sc_grpo")(case_b)
    case_b.old_logprobs = case_b.self_teacher_logprobs = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="advantage.direction='sideways'"):
        ADVANTAGE_ESTIMATORS.get("sc_grpo")(case_b, direction="sideways")


@pytest.mark.parametrize(
    "direction,top_k,micro,seed",
    [("reverse", 0, 1, 0), ("forward", 0, 2, 1), ("reverse", 1, 2, 2), ("forward", 4, 1, 3)],
)
def test_vocabulary_kl_input_and_advantages_match_reference(direction, top_k, micro, seed):
    """self_teacher_kl: per token of the sequences with a context, the KL (full vocabulary or the
    self-teacher's top-K) between the policy's forward of prompt + context + response and its plain
    forward, equal to reference token_divergence of the two; sc_grpo_vocab's advantages equal
    reference sc_grpo_vocab_advantages; 0 and w = 1 on sequences without a context."""
    g = torch.Generator().manual_seed(seed)
    b = build_batch([3, 2, 4, 2], [4, 5, 2, 3], [0, 0, 1, 1], [False] * 25, V, g, torch.float64)
    b.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    rows = torch.full((4, 3), math.nan, dtype=torch.float64)
    rows[0, :2] = torch.randint(0, V, (2,), generator=g).double()
    rows[3, :3] = torch.randint(0, V, (3,), generator=g).double()
    b.extras["self_teacher_context"] = rows
    model = TinyCausalLM(seed % 7)
    SelfTeacherKL(model, KLKnobs(top_k)).fill(b, micro)
    cu = b.cu_seqlens.tolist()
    student = model.compute_logits(b)
    teacher = student.clone()
    for i, k in ((0, 2), (3, 3)):
        p, seq = int(b.prompt_lens[i]), b.tokens[cu[i] : cu[i + 1]].tolist()
        full = model.logits(seq[:p] + [int(x) for x in rows[i, :k]] + seq[p:])
        teacher[cu[i] + p : cu[i + 1]] = full[p + k :]
    on = torch.tensor([True, False, False, True])
    on_tok = on.double().repeat_interleave(b.seq_lens)
    for col, d in enumerate(("forward", "reverse")):
        want = ref.token_divergence(student, teacher, d, top_k) * on_tok
        torch.testing.assert_close(b.token_extras[KL][:, col], want.double(), rtol=0, atol=1e-12)
    p_ = unpack(b)
    pad_s = torch.zeros(*p_.attention_mask.shape, V, dtype=torch.float64)
    pad_t = pad_s.clone()
    pad_s[p_.attention_mask], pad_t[p_.attention_mask] = student, teacher
    adv = ADVANTAGE_ESTIMATORS.get("sc_grpo_vocab")(b, direction=direction)
    want_adv = ref.sc_grpo_vocab_advantages(
        b.rewards, b.group_ids, pad_s, pad_t, p_.loss_mask, on, direction, top_k
    )[p_.attention_mask]
    torch.testing.assert_close(adv.double(), want_adv.double(), rtol=1e-9, atol=1e-12)
