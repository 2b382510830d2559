"""SRRL: the policy loss ``srrl`` (TP 1/2, DP 1/2, micro-batched) and the estimator ``srrl`` equal
reference/agents.py; the spec's invariants: all first attempts correct gives pure GRPO (no review,
nothing distilled, the PPO loss), the distillation set is exactly the fail→success episodes (their
x + a_2 without the review), the review reward is 0 when both attempts share an outcome, memory
retrieval is deterministic given the embeddings (bounded, checkpointed); the ``review`` workflow
through the real collector (scripted engine): episode layout, memory use, extras."""

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.agents as ref
from megarl.advantages.estimators import ADVANTAGE_ESTIMATORS
from megarl.batch import from_sequences, unpack
from megarl.data.dataset import PromptDataset, PromptRow, PromptSampler
from megarl.data.tokenizer import CharTokenizer
from megarl.methods.agents.srrl import (
    SD,
    ReviewMemory,
    embed,
    srrl_advantages,
    token_roles,
    top_k,
    with_distillation,
)
from megarl.objectives.api import GlobalNormalisers, LossContext
from megarl.objectives.rl_objective import ObjectiveConfig, build_objective
from megarl.plugin.inputs import RolloutInfo
from megarl.rewards.compute import RewardComputer
from megarl.rollout.review import ReviewKeys, ReviewWorkflow
from megarl.rollout.types import GenerateResult, Sample, SamplingParams
from megarl.rollout.workflow import WorkflowContext
from megarl.trainer.allocation import allocator_from_config
from megarl.trainer.collector import RolloutCollector
from megarl.trainer.config import ConfigError, from_dict
from megarl.trainer.config_sections import EnvironmentConfig
from megarl.trainer.method_runtime import MethodRuntime
from megarl.trainer.rollouts import batch_from_json, batch_to_json, build_batch, rollouts_from_groups
from tests.methods.trust_regions_harness import (
    assert_equivalent,
    megarl_method_loss_and_grad,
    padded_inputs,
    reference_method_loss_and_grad,
)
from tests.property.strategies import rl_cases

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
CFGS = st.builds(
    lambda agg, c: ObjectiveConfig(
        policy_loss="srrl", aggregation=agg, clip_low=0.2, clip_high=0.28, policy_loss_args={"sd_coef": c}
    ),
    st.sampled_from(AGGS),
    st.sampled_from([1.0, 0.5]),
)


@settings(max_examples=3, deadline=None)
@given(
    case=rl_cases(torch.float64, cfgs=CFGS),
    tp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    mb=st.integers(1, 3),
    data=st.data(),
)
def test_loss_matches_reference(case, tp, dp, mb, data):
    b = case.batch
    sd = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b.num_seqs, max_size=b.num_seqs))).double()
    b.extras = {SD: sd}

    def fn(full, pad):
        _, old, adv, mask = padded_inputs(full, pad)
        args = case.cfg.policy_loss_args
        return ref.srrl_loss(full, pad.tokens, mask, adv, old, sd, case.cfg.aggregation, args["sd_coef"])

    assert_equivalent(
        megarl_method_loss_and_grad(case, tp, dp, mb), reference_method_loss_and_grad(case, fn), case.logits
    )


def _episodes(spec, seed=0):
    """A batch of review episodes. spec: per sample (group, r1, r2, reviewed); a_1 2 tokens, then
    for reviewed ones observation 1, review 2, observation 1, a_2 3 tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts, resps, spans, masks, gids = [], [], [], [], []
    for gid, _r1, _r2, rev in spec:
        P = 2
        prompts.append(torch.randint(1, 9, (P,), generator=g).tolist())
        parts = [(2, "assistant", 1.0)] + (
            [(1, "observation", 0.0), (2, "review", 1.0), (1, "observation", 0.0), (3, "assistant", 1.0)]
            if rev
            else []
        )
        at, sp, m = P, [(0, P, "prompt")], []
        for n, role, lm in parts:
            sp.append((at, at + n, role))
            m += [lm] * n
            at += n
        resps.append(torch.randint(1, 9, (at - P,), generator=g).tolist())
        spans.append(sp)
        masks.append(m)
        gids.append(gid)
    b = from_sequences(prompts, resps, gids, rewards=[r2 for _, _, r2, _ in spec])
    from megarl.trainer.rollouts import apply_answer_masks

    apply_answer_masks(b, masks, spans)
    b.extras = {
        "review_r1": torch.tensor([s[1] for s in spec], dtype=torch.float64),
        "review_r2": torch.tensor([s[2] for s in spec], dtype=torch.float64),
        "review_c1": torch.tensor([s[1] for s in spec], dtype=torch.float64),
        "review_c2": torch.tensor([s[2] for s in spec], dtype=torch.float64),
        "reviewed": torch.tensor([float(s[3]) for s in spec], dtype=torch.float64),
    }
    return b


@settings(max_examples=10, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from([0.0, 1.0]), st.sampled_from([0.0, 1.0])),
        min_size=2,
        max_size=8,
    ),
    st.sampled_from([0.0, 0.5]),
    st.booleans(),
)
def test_estimator_matches_reference(rows, a2_coef, scale):
    spec = [(gid, r1, r1 if r1 else r2, not r1) for gid, r1, r2 in rows]  # a correct a_1 ends the episode
    b = _episodes(spec)
    got = srrl_advantages(b, scale, a2_coef)
    pad = unpack(b)
    roles = torch.zeros(pad.tokens.shape, dtype=torch.long)
    roles[pad.attention_mask] = token_roles(b)
    e = b.extras
    want = ref.srrl_advantages(
        e["review_r1"], e["review_r2"], e["reviewed"], b.group_ids, roles, pad.loss_mask, scale, a2_coef
    )
    torch.testing.assert_close(got, want[pad.attention_mask])


def _loss_and_grad(b, cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b.num_tokens, 9, generator=g, dtype=torch.float64)
    lp = torch.log_softmax(logits, -1)[torch.arange(b.num_tokens), b.tokens]
    b.old_logprobs = lp.clone()
    x = logits.clone().requires_grad_(True)
    out = build_objective(cfg)(x, b, LossContext(GlobalNormalisers.from_batch(b)))
    out.loss.backward()
    return out.loss.detach(), x.grad


def test_all_first_attempts_correct_is_pure_grpo():
    spec = [(0, 1.0, 1.0, False), (0, 1.0, 1.0, False), (1, 1.0, 1.0, False), (1, 1.0, 1.0, False)]
    b = _episodes(spec)
    b.extras["review_r1"] = b.extras["review_r2"] = b.rewards = torch.tensor(
        [1.0, 0.5, 0.2, 1.0], dtype=torch.float64
    )
    adv = srrl_advantages(b)
    assert torch.equal(adv, ADVANTAGE_ESTIMATORS.get("grpo")(b))
    b.advantages = adv
    out, n = with_distillation(b)
    assert n == 0 and out.num_seqs == 4
    for agg in AGGS:
        mine = _loss_and_grad(out, ObjectiveConfig("srrl", aggregation=agg, clip_low=0.2, clip_high=0.28))
        ppo = _loss_and_grad(out, ObjectiveConfig("ppo", aggregation=agg, clip_low=0.2, clip_high=0.28))
        assert torch.equal(mine[0], ppo[0]) and torch.equal(mine[1], ppo[1])


def test_distillation_set_is_exactly_the_fail_to_success_pairs_without_the_review():
    spec = [(0, 0.0, 1.0, True), (0, 0.0, 0.0, True), (0, 1.0, 1.0, False), (1, 0.0, 1.0, True)]
    b = _episodes(spec)
    b.advantages = srrl_advantages(b)
    out, n = with_distillation(b)
    assert n == 2 and out.num_seqs == 6 and out.extras[SD].tolist() == [0, 0, 0, 0, 1, 1]
    assert out.group_ids.tolist() == [0, 0, 0, 1, 0, 1]  # each in its episode's group
    for new, src in ((4, 0), (5, 3)):
        a, e = int(b.cu_seqlens[src]), int(b.cu_seqlens[src + 1])
        seq = b.tokens[a:e].tolist()
        want = seq[:2] + seq[-3:]  # the prompt and a_2, no a_1 / review / observations
        got = out.tokens[int(out.cu_seqlens[new]) : int(out.cu_seqlens[new + 1])].tolist()
        assert got == want
        s = slice(int(out.cu_seqlens[new]), int(out.cu_seqlens[new + 1]))
        assert out.loss_mask[s].tolist() == [0, 0, 1, 1, 1] and out.advantages[s].abs().sum() == 0
    assert ref.srrl_distill_set(
        b.extras["review_c1"], b.extras["review_c2"], b.extras["reviewed"]
    ).tolist() == [
        True,
        False,
        False,
        True,
    ]
    # the distillation sequences carry −sd_coef·log π (SFT), the episodes PPO
    cfg = ObjectiveConfig(
        "srrl", aggregation="token-sum", clip_low=0.2, clip_high=0.28, policy_loss_args={"sd_coef": 0.5}
    )
    loss, _ = _loss_and_grad(out, cfg)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(out.num_tokens, 9, generator=g, dtype=torch.float64)
    lp = torch.log_softmax(logits, -1)[torch.arange(out.num_tokens), out.tokens]
    sd_tok = out.extras[SD].repeat_interleave(out.seq_lens)
    pg = -(out.advantages * out.loss_mask * (1 - sd_tok)).sum()  # ratio 1 on-policy
    torch.testing.assert_close(loss, pg - 0.5 * (lp * out.loss_mask * sd_tok).sum())


def test_review_reward_is_zero_when_both_attempts_share_an_outcome():
    r1 = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0])
    r2 = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    rev = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    assert ref.srrl_review_reward(r1, r2, rev).tolist() == [0.0, 0.0, 1.0, -1.0, 0.0]
    b = _episodes([(0, 0.0, 0.0, True), (0, 0.0, 0.0, True), (1, 0.0, 1.0, True), (1, 0.0, 0.0, True)])
    adv, roles = srrl_advantages(b), token_roles(b)
    assert adv[(roles == 2) & (b.seq_index() < 2)].abs().sum() == 0  # group 0: both failed twice
    assert adv[(roles == 2) & (b.seq_index() == 2)].min() > 0 > adv[(roles == 2) & (b.seq_index() == 3)].max()


def test_memory_retrieval_is_deterministic_bounded_and_checkpointed():
    keys = torch.nn.functional.normalize(
        torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.6, 0.8]]), dim=1
    )
    q = torch.tensor([1.0, 0.0])
    assert top_k(q, keys, 3) == ref.srrl_memory_top_k(q, keys, 3) == [0, 2, 3]  # tie 0/2: lower first
    mem = ReviewMemory(capacity=3, k=2)
    for p, r in [("R 123=", "321"), ("R 999=", "999"), ("R 124=", "421"), ("R 555=", "555")]:
        mem.add(p, r)
    assert len(mem.entries) == 3 and mem.entries[0] == ("R 999=", "999")  # the oldest went first
    assert mem.retrieve("R 123=") == mem.retrieve("R 123=") and mem.retrieve("R 123=")[0] == "421"
    keys = torch.stack([embed(p) for p, _ in mem.entries])
    assert mem.retrieve("R 128=") == [
        mem.entries[i][1] for i in ref.srrl_memory_top_k(embed("R 128="), keys, 2)
    ]
    again = ReviewMemory(capacity=3, k=2)
    again.load_state_dict(mem.state_dict())
    assert again.entries == mem.entries and torch.equal(again.keys, mem.keys) and again.added == 4


ALPHABET = "0123456789+=RC "


class Script:
    """First answers '11'; after a review request (prompt ends with the feedback 'C' or a
    retrieved review) reviews '5'; after the cue 'R' answers '12' when the review was '5'."""

    def __init__(self, tok):
        self.tok, self.seen = tok, []

    async def generate(self, ids, n=1, sampling=None, **_):
        text = self.tok.decode(list(ids))
        self.seen.append(text)
        out = "11" if text.endswith("=") else "5" if not text.endswith("R") else "12"
        t = self.tok.encode(out, bos=False)
        return GenerateResult(list(ids), [Sample(t, [-0.25] * len(t), "stop")] * n)


def test_the_review_workflow_through_the_collector_uses_and_fills_the_memory():
    tok = CharTokenizer(ALPHABET)
    cfg = from_dict(
        {
            "model": {"alphabet": ALPHABET, "hf_config": {"model_type": "qwen3"}},
            "data": {"train": "unused.jsonl"},
            "reward": {"functions": [{"name": "correct", "kind": "exact_match", "correct": True}]},
            "environment": {"name": "review", "feedback": "C", "after_review": "R"},
            "rollout": {"n": 2},
            "schedule": {"prompts_per_step": 1, "seed": 5},
        }
    )
    rewards = RewardComputer(cfg.reward)

    def score(text, answer):
        res = rewards([text], [answer])
        return float(res.scalar[0]), bool(res.correct[0])

    mem = ReviewMemory(8, 1)
    mem.add("R 21=", "77")
    engine = Script(tok)
    ds = PromptDataset([PromptRow(prompt="R 21=", answer="12", task="reverse", source="mem:0")])
    c = RolloutCollector(
        engine=engine,
        tokenizer=tok,
        dataset=ds,
        sampler=PromptSampler(1, 0),
        rewards=rewards,
        workflow=ReviewWorkflow(WorkflowContext(tok, score, None, cfg.environment, parts={"memory": mem})),
        processors=[mem],
        allocator=allocator_from_config(cfg),
        sampling=lambda step, rnd, i: SamplingParams(max_new_tokens=4, seed=3),
        n=2,
        weights={"correct": 1.0},
        fallback=0.0,
        version=lambda: 0,
    )
    collected = batch_from_json(batch_to_json(asyncio.run(c.collect(1))))
    ro = rollouts_from_groups(collected.groups, ds.task_id, rewards.names, False)
    b = build_batch(ro, 1)
    MethodRuntime.add_round_extras(b, RolloutInfo(ro.answers, ro.reward_dims, ro.extras))
    assert engine.seen.count("R 21=") == 1  # the first answers: one request of n
    assert "R 21=11C 775R" in engine.seen  # the retrieved review follows the feedback
    seq = tok.decode(b.tokens[: int(b.cu_seqlens[1])].tolist())
    assert seq.endswith("R 21=11C 775R12")
    assert b.rewards.tolist() == [1.0, 1.0]  # the last answer is scored
    assert b.extras["review_r1"].tolist() == [0.0, 0.0] and b.extras["review_c2"].tolist() == [1.0, 1.0]
    assert b.extras["reviewed"].tolist() == [1.0, 1.0]
    roles = token_roles(b)[: int(b.cu_seqlens[1])]
    assert tok.decode(b.tokens[: int(b.cu_seqlens[1])][roles == 2].tolist()) == "5"
    assert (
        tok.decode(b.tokens[: int(b.cu_seqlens[1])][b.loss_mask[: int(b.cu_seqlens[1])] > 0].tolist())
        == "11512"
    )
    assert (
        mem.entries[-2:] == [("R 21=", "5"), ("R 21=", "5")] and mem.added == 3
    )  # successful reviews stored
    bad = {
        "model": {"alphabet": ALPHABET, "hf_config": {"model_type": "qwen3"}},
        "data": {"train": "unused.jsonl"},
        "environment": {"name": "review", "after_review": "{x}"},
    }
    with pytest.raises(ConfigError, match="environment.after_review"):  # at load
        from_dict(bad)
    bad_env = EnvironmentConfig(name="review", chosen=ReviewKeys(after_review="{x}"))
    with pytest.raises(ValueError, match="environment.after_review"):  # and when built in code
        ReviewWorkflow(WorkflowContext(tok, score, None, bad_env))
