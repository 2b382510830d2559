"""Experiential Learning (policy loss ``el``) and ICE (``ice``): megarl (TP 1/2, DP 1/2,
micro-batched) equals reference/agents.py in loss and gradient; the spec's invariants: no knowledge
(k = ∅) gives zero loss and gradient, the teachers are stop-gradient, only response tokens carry
loss; ICE without instructions is exactly PPO-clip (GRPO), and its distillation gradient is zero on
non-positive samples; the coach's rows; the context teacher forwards prompt + context + response."""

import asyncio
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.agents as ref
from megarl.batch import from_sequences
from megarl.data.tokenizer import CharTokenizer
from megarl.methods.agents.context_teacher import ContextTeacher
from megarl.methods.agents.el import Coach, CoachKnobs
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective
from megarl.plugin.rounds import RolloutRound
from megarl.rollout.types import GenerateResult, Sample
from tests.methods.trust_regions_harness import (
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _cfgs(loss: str, arg: str, values):
    return st.builds(
        lambda agg, v: ObjectiveConfig(
            policy_loss=loss, aggregation=agg, clip_low=0.2, clip_high=0.28, policy_loss_args={arg: v}
        ),
        st.sampled_from(AGGS),
        st.sampled_from(values),
    )


def _reference(case, on, fn, arg):
    args = case.cfg.policy_loss_args

    def loss(full, pad):
        _, old, adv, mask = padded_inputs(full, pad)
        return fn(
            full,
            pad.tokens,
            mask,
            adv,
            old,
            pad.per_token["self_teacher_logprobs"],
            on,
            case.cfg.aggregation,
            args[arg],
            0.2,
            0.28,
        )

    return reference_method_loss_and_grad(case, loss)


@pytest.mark.parametrize(
    "loss,arg,values,fn",
    [("el", "rl_coef", [0.0, 0.5], ref.el_loss), ("ice", "sd_coef", [1.0, 0.3], ref.ice_loss)],
)
def test_matches_reference(loss, arg, values, fn):
    @settings(max_examples=3, deadline=None)
    @given(
        case=rl_cases(torch.float64, cfgs=_cfgs(loss, arg, values)),
        tp=st.sampled_from([1, 2]),
        dp=st.sampled_from([1, 2]),
        mb=st.integers(1, 3),
        data=st.data(),
    )
    def check(case, tp, dp, mb, data):
        b = case.batch
        on = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b.num_seqs, max_size=b.num_seqs)))
        b.self_teacher_logprobs = b.teacher_logprobs
        b.extras = {"self_teacher_on": on.double()}
        assert_equivalent(
            megarl_method_loss_and_grad(case, tp, dp, mb), _reference(case, on.double(), fn, arg), case.logits
        )

    check()


def _batch(n=4, seed=0, V=9, adv=None):
    g = torch.Generator().manual_seed(seed)
    b = from_sequences(
        [[1, 2, 3]] * n, [[4, 5, 6, 7][: 2 + i % 3] for i in range(n)], [0] * (n // 2) + [1] * (n - n // 2)
    )
    logits = torch.randn(b.num_tokens, V, generator=g, dtype=torch.float64)
    logp = torch.log_softmax(logits, -1)[torch.arange(b.num_tokens), b.tokens]
    b.old_logprobs = logp.clone()  # on-policy
    b.self_teacher_logprobs = (logp - torch.rand(b.num_tokens, generator=g, dtype=torch.float64)).clamp(max=0)
    a = torch.tensor(adv if adv is not None else [1.0, -1.0, 0.5, -0.5][:n], dtype=torch.float64)
    b.advantages = a[b.seq_index()] * b.loss_mask.double()
    b.extras = {"self_teacher_on": torch.ones(n, dtype=torch.float64)}
    return b, logits


def _loss_and_grad(b, logits, cfg):
    obj = build_objective(cfg)
    x = logits.clone().requires_grad_(True)
    out = obj(x, b, LossContext(GlobalNormalisers.from_batch(b)))
    out.loss.backward()
    return out.loss.detach(), x.grad


def test_el_no_knowledge_gives_zero_and_only_response_tokens_carry_loss():
    cfg = ObjectiveConfig("el", aggregation="token-mean", policy_loss_args={"rl_coef": 0.0})
    b, logits = _batch()
    b.extras["self_teacher_on"] = torch.zeros(4, dtype=torch.float64)
    loss, grad = _loss_and_grad(b, logits, cfg)
    assert loss == 0 and bool((grad == 0).all())
    b, logits = _batch()
    b.self_teacher_logprobs = b.old_logprobs.clone()  # teacher = student (k = ∅ read as context)
    loss, grad = _loss_and_grad(b, logits, cfg)
    assert loss == 0 and bool((grad == 0).all())
    b, logits = _batch()
    _, grad = _loss_and_grad(b, logits, cfg)
    assert bool((grad[b.loss_mask == 0] == 0).all()) and bool((grad[b.loss_mask > 0] != 0).any())


def test_el_teacher_is_stop_gradient_and_the_gradient_is_the_gap_weighted_score():
    b, logits = _batch()
    b.self_teacher_logprobs.requires_grad_(True)
    cfg = ObjectiveConfig("el", aggregation="token-sum", policy_loss_args={"rl_coef": 0.0})
    _, grad = _loss_and_grad(b, logits, cfg)
    assert b.self_teacher_logprobs.grad is None
    # on-policy: d/dlogits of −Σ sg(ℓ_t) log π(y_t)
    x = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(x, -1)[torch.arange(b.num_tokens), b.tokens]
    gap = (b.self_teacher_logprobs.detach() - b.old_logprobs) * b.loss_mask.double()
    (-(gap * lp).sum()).backward()
    torch.testing.assert_close(grad, x.grad)


def test_ice_without_instructions_is_ppo_and_distils_only_positive_instructed_samples():
    for agg in AGGS:
        b, logits = _batch(adv=[1.0, -1.0, 0.5, -0.5])
        b.extras["self_teacher_on"] = torch.zeros(4, dtype=torch.float64)
        mine = _loss_and_grad(
            b, logits, ObjectiveConfig("ice", aggregation=agg, policy_loss_args={"sd_coef": 1.0})
        )
        ppo = _loss_and_grad(b, logits, ObjectiveConfig("ppo", aggregation=agg, clip_low=0.2, clip_high=0.28))
        assert torch.equal(mine[0], ppo[0]) and torch.equal(mine[1], ppo[1])
    # the SD gradient (ice minus ppo) is zero on negative samples and non-zero on positive ones
    b, logits = _batch(adv=[1.0, -1.0, 0.5, -0.5])
    _, g_ice = _loss_and_grad(
        b, logits, ObjectiveConfig("ice", aggregation="token-sum", policy_loss_args={"sd_coef": 1.0})
    )
    _, g_ppo = _loss_and_grad(
        b, logits, ObjectiveConfig("ppo", aggregation="token-sum", clip_low=0.2, clip_high=0.28)
    )
    sd = (g_ice - g_ppo).abs().sum(-1)
    seq = b.seq_index()
    resp = b.loss_mask > 0
    assert float(sd[(seq % 2 == 1) & resp].max()) == 0.0  # A < 0
    assert float(sd[(seq % 2 == 0) & resp].min()) > 0.0  # A > 0
    b.self_teacher_logprobs.requires_grad_(True)
    _loss_and_grad(
        b, logits, ObjectiveConfig("ice", aggregation="token-sum", policy_loss_args={"sd_coef": 1.0})
    )
    assert b.self_teacher_logprobs.grad is None


ALPHABET = "0123456789+=RC "


class Scripted:
    """Replies '77' to every request and records the prompts."""

    def __init__(self):
        self.prompts = []

    async def generate(self, prompt_ids, n=1, sampling=None, **_):
        self.prompts.append((list(prompt_ids), sampling.seed))
        return GenerateResult(list(prompt_ids), [Sample([7, 7, 7], [-0.1] * 3, "stop")] * n)


def _round(tok, correct):
    texts = ["12", "21", "33", "12"]
    return RolloutRound(
        ["R 12=", "R 33="],
        ["21", "33"],
        [5, 6],
        [tok.encode("R 12="), tok.encode("R 33=")],
        [tok.encode(t, bos=False) for t in texts],
        texts,
        {},
        torch.zeros(4),
        2,
        3,
        0,
        correct=torch.tensor(correct),
    )


def test_the_coach_writes_knowledge_rows_by_template_or_through_the_engine():
    tok = CharTokenizer(ALPHABET)
    k = CoachKnobs(
        template="{verdict}{answer}",
        verdict_correct="C",
        verdict_incorrect="R",
        when="incorrect",
        max_tokens=4,
    )
    k.check()
    out = asyncio.run(Coach(tok, k).process(_round(tok, [False, True, True, False])))
    rows = out.extras["coach_context"]
    assert [len(r) for r in rows] == [4] * 4
    assert tok.decode([int(x) for x in rows[0] if not math.isnan(x)]) == "R21"
    assert all(math.isnan(x) for x in rows[1]) and all(math.isnan(x) for x in rows[2])
    assert tok.decode([int(x) for x in rows[3] if not math.isnan(x)]) == "R33"
    assert out.metrics["coach/knowledge_frac"] == 0.5
    eng = Scripted()
    kp = CoachKnobs(coach="policy", template="{prompt}{response}", when="all", max_tokens=2)
    out = asyncio.run(Coach(tok, kp, eng).process(_round(tok, [False, True, True, False])))
    assert [tok.decode(p) for p, _ in eng.prompts] == ["R 12=12", "R 12=21", "R 33=33", "R 33=12"]
    assert len({s for _, s in eng.prompts}) == 4  # one seed per sample
    assert all(r == [7.0, 7.0] for r in out.extras["coach_context"])  # the reply, cut to max_tokens
    with pytest.raises(ValueError, match="max_tokens"):
        asyncio.run(
            Coach(tok, CoachKnobs(template="{answer}{answer}{answer}", max_tokens=4)).process(
                _round(tok, [True] * 4)
            )
        )
    with pytest.raises(ValueError, match="template"):
        CoachKnobs(template="{score}").check()


class Recorder:
    """compute_logprobs of a batch: returns each token's id / -100 and keeps the batch."""

    def compute_logprobs(self, batch, micro_batches):
        self.seen = batch
        return -batch.tokens.double() / 100, None


def test_the_context_teacher_forwards_prompt_context_response_for_rows_with_a_context():
    b = from_sequences([[1, 2]] * 3, [[3, 4], [5], [6, 7]], [0, 0, 1])
    nan = math.nan
    b.extras = {"instruction_context": torch.tensor([[9.0, 8.0], [nan, nan], [9.0, nan]])}
    pol = Recorder()
    metrics = ContextTeacher(pol, "instruction_context", "instruction_logprobs").fill(b, 1)
    seqs = [
        pol.seen.tokens[int(pol.seen.cu_seqlens[i]) : int(pol.seen.cu_seqlens[i + 1])].tolist()
        for i in range(2)
    ]
    assert seqs == [[1, 2, 9, 8, 3, 4], [1, 2, 9, 6, 7]]
    assert b.extras["self_teacher_on"].tolist() == [1.0, 0.0, 1.0]
    resp = b.loss_mask > 0
    assert torch.allclose(
        b.self_teacher_logprobs[resp], -b.tokens[resp].float() / 100 * torch.tensor([1, 1, 0, 1, 1.0])
    )
    assert metrics["instruction_logprobs/forwarded_frac"] == pytest.approx(2 / 3)
    b.extras = {}
    with pytest.raises(ValueError, match="instruction_context"):
        ContextTeacher(pol, "instruction_context", "instruction_logprobs").fill(b, 1)
