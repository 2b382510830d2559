"""SRPO: the packed estimator equals reference/agents.py:srpo_advantages and the PPO loss on its
advantages equals the reference loss (gradient too) at TP 1/2 with micro-batches and DP splits; the
spec's invariants: an empty patch gives GRPO exactly, the teacher path carries no gradient, the
patch is read only in the privileged forward (the trained sequence holds no patch token; a plain
forward of prompt + patch + response gives the teacher's logprobs); the patch round input
(template and generated) with its errors."""

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.agents as ref
from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.advantages.estimators import grpo, per_token
from megarl.batch import from_sequences, unpack
from megarl.methods.agents.context_teacher import ContextTeacher
from megarl.methods.agents.srpo import LOGPROBS, PATCH, PatchKnobs, ReflectionPatch
from megarl.methods.distillation.self_teacher import ON
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.plugin.knobs import build_knobs
from megarl.plugin.rounds import RolloutRound
from megarl.testing.equivalence import megarl_loss_and_grad, reference_loss_and_grad
from tests.methods.helpers import load_example
from tests.methods.reflection_engine import ScriptedEngine, char_tokenizer
from tests.methods.test_self_teacher import TinyCausalLM
from tests.property.strategies import rl_cases

KNOBS = st.fixed_dictionaries(
    {
        "coef": st.sampled_from([1.0, 0.3]),
        "gap_clip": st.sampled_from([0.0, 0.5]),
        "with_outcome": st.booleans(),
        "scale_by_std": st.booleans(),
    }
)
CFGS = st.sampled_from([ObjectiveConfig("ppo", aggregation=a) for a in ("token-mean", "seq-mean-token-mean")])


@settings(max_examples=3, deadline=None)
@given(
    rl_cases(torch.float64, cfgs=CFGS),
    KNOBS,
    st.sampled_from([(1, 1, 1), (2, 2, 1), (1, 2, 3), (2, 1, 2)]),
    st.data(),
)
def test_advantages_and_loss_match_reference_tp_dp_micro(case, knobs, layout, data):
    b = case.batch
    on = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b.num_seqs, max_size=b.num_seqs)))
    b.self_teacher_logprobs = b.teacher_logprobs.clone()
    b.extras = {ON: on.double()}
    adv = ADVANTAGE_ESTIMATORS.get("srpo")(b, **knobs)
    p = unpack(b)
    want = ref.srpo_advantages(
        b.rewards,
        b.group_ids,
        p.per_token["teacher_logprobs"],
        p.per_token["old_logprobs"],
        p.loss_mask,
        on,
        **knobs,
    )[p.attention_mask]
    torch.testing.assert_close(adv, want, rtol=1e-12, atol=1e-12)
    b.advantages = adv
    tp, dp, mb = layout
    ref_loss, ref_grad = reference_loss_and_grad(case)
    loss, grad = megarl_loss_and_grad(case, tp=tp, dp=dp, micro_batches=min(mb, b.num_seqs))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_loss.abs())))
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-10 * max(1.0, float(ref_grad.abs().max())))


def _batch():
    b = from_sequences([[1, 2], [1, 2], [1, 3], [1, 3]], [[4, 5, 6], [7, 4], [5, 5], [6]], [0, 0, 1, 1])
    b.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    b.old_logprobs = torch.linspace(-2.0, -0.1, b.num_tokens, dtype=torch.float64) * b.loss_mask
    return b


def test_empty_patch_is_grpo_and_the_teacher_path_has_no_gradient():
    b = _batch()
    b.self_teacher_logprobs = torch.full((b.num_tokens,), -0.3, dtype=torch.float64, requires_grad=True)
    b.extras[ON] = torch.zeros(b.num_seqs, dtype=torch.float64)  # no sample got a patch
    adv = ADVANTAGE_ESTIMATORS.get("srpo")(b)
    assert torch.equal(adv, per_token(b, grpo(b.rewards.double(), b.group_ids)))
    b.extras[ON] = torch.ones(b.num_seqs, dtype=torch.float64)
    adv = ADVANTAGE_ESTIMATORS.get("srpo")(b, coef=0.5)
    assert not adv.requires_grad  # the gap is data: no gradient reaches the privileged forward
    assert bool((adv[b.loss_mask == 0] == 0).all())  # only response positions carry a signal
    assert not torch.equal(adv, per_token(b, grpo(b.rewards.double(), b.group_ids)))


def test_the_patch_is_read_only_by_the_privileged_forward():
    b = _batch()
    width = 4
    patches = [[8, 9], [], [10, 11, 9, 8], [3]]
    b.extras[PATCH] = torch.tensor(
        [[float(t) for t in x] + [float("nan")] * (width - len(x)) for x in patches], dtype=torch.float64
    )
    tokens_before = b.tokens.clone()
    model = TinyCausalLM()
    ContextTeacher(model, PATCH, LOGPROBS).fill(b, 2)
    assert torch.equal(b.tokens, tokens_before)  # the trained sequences hold no patch token
    assert b.extras[ON].tolist() == [1.0, 0.0, 1.0, 1.0]
    cu = b.cu_seqlens.tolist()
    for i, x in enumerate(patches):
        got = b.self_teacher_logprobs[cu[i] : cu[i + 1]]
        if not x:
            assert bool((got == 0).all())
            continue
        seq, p = b.tokens[cu[i] : cu[i + 1]].tolist(), int(b.prompt_lens[i])
        full = model.logprobs(seq[:p] + x + seq[p:])
        torch.testing.assert_close(got, torch.cat([full[:p], full[p + len(x) :]]).float(), rtol=0, atol=1e-6)


def _round(tok, texts, correct):
    n = len(texts) // 2
    return RolloutRound(
        ["q1 ", "q2 "],
        ["12", "34"],
        [0, 1],
        [tok.encode("q1 "), tok.encode("q2 ")],
        [tok.encode(t, bos=False) for t in texts],
        texts,
        {},
        torch.zeros(len(texts)),
        n,
        3,
        0,
        correct=torch.tensor(correct),
    )


def _sampling(step, rnd, i, greedy=False):
    from megarl.rollout.types import SamplingParams

    return SamplingParams(max_new_tokens=64, seed=step * 100 + rnd * 10 + i)


def test_patch_round_input_template_and_generated():
    tok = char_tokenizer()
    r = _round(tok, ["12", "13", "30", "34"], [True, False, False, True])
    k = build_knobs(
        PatchKnobs, {"mode": "template", "when": "incorrect", "max_tokens": 40}, f"inputs.{PATCH}"
    )
    out = asyncio.run(ReflectionPatch(tok, k).process(r))
    rows = out.extras[PATCH]
    texts = [tok.decode([int(x) for x in row if x == x]) for row in rows]
    assert texts == ["", " earlier: 13 was wrong.", " earlier: 30 was wrong.", ""]
    engine = ScriptedEngine(tok, lambda prompt, seed: "check the last digit" if "wrong" in prompt else "ok")
    k = build_knobs(PatchKnobs, {"max_tokens": 8}, f"inputs.{PATCH}")
    out = asyncio.run(ReflectionPatch(tok, k, engine, _sampling).process(r))
    texts = [tok.decode([int(x) for x in row if x == x]) for row in out.extras[PATCH]]
    assert texts == ["ok", "check th", "check th", "ok"]  # cut to max_tokens
    assert engine.prompts[1] == "q1 13\nfeedback: wrong\nreflection:"
    assert out.metrics["srpo/patch_frac"] == 1.0


def test_example_and_errors_are_named():
    cfg = load_example("srpo")
    assert cfg["advantage"]["estimator"] == "srpo" and cfg["inputs"][PATCH]["mode"] == "template"
    with pytest.raises(ValueError, match="mode='dream'"):
        build_knobs(PatchKnobs, {"mode": "dream"}, f"inputs.{PATCH}")
    with pytest.raises(ValueError, match="template="):
        build_knobs(PatchKnobs, {"template": "{verdict}"}, f"inputs.{PATCH}")
    with pytest.raises(ValueError, match="needs rank 0's rollout engine"):
        ReflectionPatch(char_tokenizer(), PatchKnobs())
    tok = char_tokenizer()
    r = _round(tok, ["12", "13", "30", "34"], [True, False, False, True])
    r.correct = None
    with pytest.raises(ValueError, match="correctness check"):
        asyncio.run(ReflectionPatch(tok, PatchKnobs(mode="template")).process(r))
    b = _batch()
    with pytest.raises(ValueError, match=LOGPROBS):
        ADVANTAGE_ESTIMATORS.get("srpo")(b)
