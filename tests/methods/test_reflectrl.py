"""ReflectRL: megarl (advantages, then the reflectrl policy loss packed, TP 1/2, DP 1/2,
micro-batched) equals reference/agents.py in loss and gradient; the spec's invariants: no golden
negatives gives GRPO with PPO clip exactly, the reflection context gets no loss, w = 1 (the context
changes nothing) reduces the transfer term to on-policy PPO; the ``reflect`` workflow's samples
(roles, token-exact sequences, a correct trajectory is no negative, annealing) and the transfer
copies' privileged forward (equal to the reflective sequence's own logprobs)."""

import asyncio
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.agents as ref
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import grpo, per_token
from megarl.batch import from_sequences
from megarl.methods.agents.context_teacher import ContextTeacher
from megarl.methods.agents.reflectrl import LOGPROBS, reflectrl_loss
from megarl.methods.distillation.self_teacher import ON
from megarl.objectives.policy_losses import ppo
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.rollout.reflect import CONTEXT, ROLE, ReflectKeys, ReflectWorkflow
from megarl.rollout.types import SamplingParams
from megarl.rollout.workflow import WorkflowContext
from tests.methods.helpers import load_example
from tests.methods.reflection_engine import ScriptedEngine, char_tokenizer
from tests.methods.test_self_teacher import TinyCausalLM
from tests.methods.trust_regions_harness import megarl_method_loss_and_grad, reference_method_loss_and_grad
from tests.property.strategies import rl_cases

AGGS = ("token-mean", "seq-mean-token-mean")
CFGS = st.builds(
    lambda agg, coef: ObjectiveConfig(
        policy_loss="reflectrl", aggregation=agg, policy_loss_args={"r2d_coef": coef}
    ),
    st.sampled_from(AGGS),
    st.sampled_from([1.0, 0.5]),
)


@settings(max_examples=3, deadline=None)
@given(
    case=rl_cases(torch.float64, cfgs=CFGS),
    layout=st.sampled_from([(1, 1, 1), (2, 2, 1), (1, 2, 3), (2, 1, 2)]),
    scale=st.booleans(),
    data=st.data(),
)
def test_advantages_and_loss_match_reference_tp_dp_micro(case, layout, scale, data):
    b = case.batch
    role = torch.tensor(
        data.draw(st.lists(st.sampled_from([0, 1, 2]), min_size=b.num_seqs, max_size=b.num_seqs))
    )
    b.extras = {ROLE: role.double()}
    b.self_teacher_logprobs = b.teacher_logprobs.clone()
    adv = ADVANTAGE_ESTIMATORS.get("reflectrl")(b, scale_by_std=scale)
    want = ref.reflectrl_advantages(b.rewards, b.group_ids, role, scale_by_std=scale)
    torch.testing.assert_close(adv, per_token(b, want), rtol=1e-12, atol=1e-12)
    b.advantages = adv.to(b.old_logprobs.dtype)
    cfg = case.cfg

    def reference(full, pad):
        t = pad.per_token
        return ref.reflectrl_loss(
            full,
            pad.tokens,
            pad.loss_mask,
            t["advantages"],
            t["old_logprobs"],
            t["teacher_logprobs"],
            role,
            cfg.clip_low or 0.2,
            cfg.clip_high or 0.28,
            cfg.policy_loss_args["r2d_coef"],
            cfg.aggregation,
        )

    ref_loss, ref_grad = reference_method_loss_and_grad(case, reference)
    tp, dp, mb = layout
    loss, grad = megarl_method_loss_and_grad(case, tp=tp, dp=dp, micro_batches=min(mb, b.num_seqs))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_loss.abs())))
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_grad.abs().max())))


def _batch(roles):
    b = from_sequences([[1, 2]] * 4, [[4, 5, 6], [7, 4], [5, 5], [6, 7]], [0, 0, 0, 0])
    b.rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    b.old_logprobs = torch.linspace(-2.0, -0.1, b.num_tokens, dtype=torch.float64) * b.loss_mask
    b.extras[ROLE] = torch.tensor(roles, dtype=torch.float64)
    return b


def test_no_golden_negative_is_grpo_and_w_one_is_on_policy_ppo():
    b = _batch([0, 0, 0, 0])
    adv = ADVANTAGE_ESTIMATORS.get("reflectrl")(b)
    assert torch.equal(adv, per_token(b, grpo(b.rewards.double(), b.group_ids)))
    logp = (b.old_logprobs + 0.3 * torch.sin(torch.arange(b.num_tokens))).requires_grad_(True)
    args = (logp, b.old_logprobs, adv, b.loss_mask, b.cu_seqlens)
    assert torch.equal(reflectrl_loss(*args, batch=b), ppo(*args))
    b = _batch([0, 1, 1, 2])  # a transfer copy whose context changes nothing: w = π/π_old
    b.self_teacher_logprobs = b.old_logprobs.clone()
    adv = ADVANTAGE_ESTIMATORS.get("reflectrl")(b)
    assert float(adv[b.extras[ROLE].repeat_interleave(b.seq_lens) == 2].min()) >= 0  # only successes transfer
    args = (logp, b.old_logprobs, adv, b.loss_mask, b.cu_seqlens)
    torch.testing.assert_close(reflectrl_loss(*args, batch=b), ppo(*args), rtol=0, atol=0)


def _workflow(tmp_path, rows, frac=0.5, anneal=0):
    tok = char_tokenizer()
    path = tmp_path / "neg.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    class Env:
        chosen = ReflectKeys(str(path), " no: {trajectory}.", frac, anneal)

    score = lambda text, answer: (float(text.strip() == answer), text.strip() == answer)  # noqa: E731
    return tok, ReflectWorkflow(WorkflowContext(tok, score, 64, Env()))


def test_reflect_workflow_samples_roles_and_exact_tokens(tmp_path):
    tok, wf = _workflow(
        tmp_path, [{"prompt": "q 12?", "trajectory": "31"}, {"prompt": "q 34?", "trajectory": "43"}]
    )
    engine = ScriptedEngine(tok, lambda prompt, seed: "21" if "no:" in prompt else "20")
    sp = SamplingParams(max_new_tokens=4, seed=5)
    p = tok.encode("q 12?")
    out = asyncio.run(wf.run(engine, "q 12?", "21", p, 4, sp))
    assert [t.extras[ROLE] for t in out] == [0.0, 0.0, 1.0, 2.0]
    ctx = tok.encode(" no: 31.", bos=False)
    refl, copy = out[2], out[3]
    assert refl.token_ids == ctx + tok.encode("21", bos=False) and copy.token_ids == tok.encode(
        "21", bos=False
    )
    assert refl.loss_mask == [0.0] * len(ctx) + [1.0, 1.0] and refl.text == copy.text == "21"
    assert refl.turn_spans == [
        (0, len(p), "prompt"),
        (len(p), len(p) + len(ctx), "observation"),
        (len(p) + len(ctx), len(p) + len(ctx) + 2, "assistant"),
    ]
    assert [int(x) for x in copy.extras[CONTEXT] if not math.isnan(x)] == ctx
    assert all(math.isnan(x) for x in out[0].extras[CONTEXT])
    # a trajectory the correctness check accepts is no golden negative: n direct samples
    out = asyncio.run(wf.run(engine, "q 34?", "43", tok.encode("q 34?"), 4, sp))
    assert [t.extras[ROLE] for t in out] == [0.0] * 4
    _, wf = _workflow(tmp_path, [{"prompt": "q 12?", "trajectory": "31"}], frac=1.0, anneal=4)
    assert [wf.reflective_count(4, v) for v in (0, 1, 2, 3, 4, 9)] == [2, 2, 1, 1, 0, 0]
    assert wf.reflective_count(5, 0) == 2  # never more than n // 2 pairs


def test_transfer_copies_read_with_their_context_equal_the_reflective_sequence(tmp_path):
    ctx = [8, 9, 10]
    b = from_sequences([[3, 4], [3, 4]], [ctx + [5, 6], [5, 6]], [0, 0])
    b.loss_mask[2:5] = 0  # the reflective sequence's context is an observation
    nan = float("nan")
    b.extras[CONTEXT] = torch.tensor([[nan] * 3, [float(t) for t in ctx]], dtype=torch.float64)
    model = TinyCausalLM()
    ContextTeacher(model, CONTEXT, LOGPROBS).fill(b, 1)
    own, _ = model.compute_logprobs(b)
    assert b.extras[ON].tolist() == [0.0, 1.0]
    torch.testing.assert_close(b.self_teacher_logprobs[-2:], own[5:7].float(), rtol=0, atol=1e-6)


def test_example_and_errors_are_named(tmp_path):
    cfg = load_example("reflectrl")
    assert cfg["environment"]["name"] == "reflect" and cfg["objective"]["policy_loss"] == "reflectrl"
    with pytest.raises(ValueError, match="extras\\['reflect_role'\\]"):
        ADVANTAGE_ESTIMATORS.get("reflectrl")(from_sequences([[1]], [[2]], [0], rewards=[1.0]))
    b = _batch([0, 1, 1, 2])
    adv = ADVANTAGE_ESTIMATORS.get("reflectrl")(b)
    with pytest.raises(ValueError, match="the reflect_logprobs input"):
        reflectrl_loss(b.old_logprobs, b.old_logprobs, adv, b.loss_mask, b.cu_seqlens, batch=b)
    with pytest.raises(ValueError, match="line 2: field 'trajectory'"):
        _workflow(tmp_path, [{"prompt": "a", "trajectory": "1"}, {"prompt": "b"}])
    with pytest.raises(ValueError, match="reflect_frac=2"):
        _workflow(tmp_path, [], frac=2.0)


def test_role_rewards_report_the_reflection_advantage():
    from megarl.methods.agents.reflectrl import RoleRewards
    from megarl.plugin.rounds import RolloutRound

    r = RolloutRound(
        ["q"],
        ["1"],
        [0],
        [[1]],
        [[2]] * 4,
        ["0", "1", "1", "1"],
        {},
        torch.tensor([0.0, 1.0, 1.0, 1.0]),
        4,
        1,
        0,
    )
    r.extras = {ROLE: [0.0, 0.0, 1.0, 2.0]}
    out = asyncio.run(RoleRewards().process(r))
    assert out.metrics == {
        "reflectrl/reflective_frac": 0.25,
        "reflectrl/reward_direct": 0.5,
        "reflectrl/reward_reflective": 1.0,
    }
    assert out.scalar is None and out.extras == {}


def test_transfer_term_with_its_coefficient_matches_reference_tp2_dp2_micro():
    """A group with every role and a rewarded transfer copy (the R2D path carries a gradient)."""
    from megarl.testing.equivalence import Case

    b = from_sequences([[1, 2]] * 6, [[3, 4, 5], [6, 3], [4, 4, 7], [5, 6], [3, 7, 7], [2, 5]], [0] * 6)
    b.rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    b.extras[ROLE] = torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0, 2.0])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b.num_tokens, 8, generator=g, dtype=torch.float64)
    logp = torch.log_softmax(logits, -1).gather(-1, b.tokens[:, None])[:, 0]
    b.old_logprobs = (logp + 0.1 * torch.randn(b.num_tokens, generator=g, dtype=torch.float64)).clamp(max=0)
    b.self_teacher_logprobs = (
        logp + 0.4 * torch.randn(b.num_tokens, generator=g, dtype=torch.float64)
    ).clamp(max=0)
    adv = ADVANTAGE_ESTIMATORS.get("reflectrl")(b)
    assert float(adv[int(b.cu_seqlens[4]) + 2]) > 0 and float(adv[int(b.cu_seqlens[5]) + 2]) == 0
    b.advantages = adv
    losses = []
    for coef in (0.5, 1.0):
        cfg = ObjectiveConfig(
            policy_loss="reflectrl", aggregation="token-mean", policy_loss_args={"r2d_coef": coef}
        )
        case = Case(b, logits, cfg)

        def reference(full, pad, coef=coef):
            t = pad.per_token
            role = b.extras[ROLE].long()
            return ref.reflectrl_loss(
                full,
                pad.tokens,
                pad.loss_mask,
                t["advantages"],
                t["old_logprobs"],
                t["self_teacher_logprobs"],
                role,
                0.2,
                0.28,
                coef,
                "token-mean",
            )

        ref_loss, ref_grad = reference_method_loss_and_grad(case, reference)
        loss, grad = megarl_method_loss_and_grad(case, tp=2, dp=2, micro_batches=2)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
        losses.append(float(loss))
    assert losses[0] != losses[1]  # the coefficient reaches the transfer term
