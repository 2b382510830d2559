"""SpecRoll: the speculative sampler equals reference/rollout.py draw for draw, its output law is the
target's (exact enumeration for the reference; chi-square for the plugin's sampler and for the
embedded engine with the decoder installed, each with a control that must fail), the acceptance
rate is sum_x min(p, q), the engine's logprobs are the model's teacher-forced ones, the Reflex
correction stays inside its ball and restarts per sample, and the slow path retrains the heads.
"""

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.methods.allocation.specroll import SpecRollKnobs, SpecRollPart, build
from megarl.methods.allocation.specroll_decode import reflex_step, verify_candidates, verify_round
from megarl.plugin.knobs import build_knobs
from megarl.rollout.embedded import EmbeddedEngine, teacher_forced_logprobs
from megarl.rollout.types import SamplingParams
from reference import rollout as ref

FAST = settings(max_examples=12, deadline=None)
V = 4


def _dist(seed: int, v: int = V, sharp: float = 2.0, zeros: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(sharp * torch.randn(v, generator=g), -1)
    if zeros:  # a support mismatch: p or q puts no mass on some tokens
        p[int(torch.randint(v, (1,), generator=g))] = 0
        p = p / p.sum()
    return p


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit (cells with expected count < 5 pooled into one)."""
    n = float(counts.sum())
    exp = probs.double() * n
    small = exp < 5
    obs = torch.cat([counts.double()[~small], counts.double()[small].sum().reshape(1)])
    exp = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = max(len(obs) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


@FAST
@given(sp=st.integers(0, 10**6), sq=st.integers(0, 10**6), width=st.integers(1, 3), z=st.booleans())
def test_reference_sibling_law_is_exactly_p(sp, sq, width, z):
    """Enumerating every candidate tuple and accept/reject path: the emitted token's law is p."""
    p, q = _dist(sp, zeros=z), _dist(sq, sharp=1.0, zeros=not z)
    law = ref.sibling_output_law(p, q, width)
    assert torch.allclose(law, p.double(), atol=1e-12)
    # one candidate is accepted with chance sum_x min(p, q)
    acc = sum(float(q[x]) * ref.accept_prob(p, q, x) for x in range(V))
    assert acc == pytest.approx(ref.expected_acceptance(p, q), abs=1e-6)


@FAST
@given(
    seed=st.integers(0, 10**6),
    S=st.integers(1, 3),
    K=st.integers(1, 3),
    temp0=st.booleans(),
)
def test_plugin_round_equals_reference_draw_for_draw(seed, S, K, temp0):
    """verify_round (plugin) and verify_tree (reference) on the same inputs and generator seed."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(3 * torch.randn(S, K + 1, V, generator=g), -1)
    p[:, 0] = p[0, 0].clone()  # the first position is the same for every sibling
    q = torch.softmax(torch.randn(K, V, generator=g), -1)
    if temp0:  # greedy: one-hot target and drafter
        p = torch.nn.functional.one_hot(p.argmax(-1), V).float()
        q = torch.nn.functional.one_hot(q.argmax(-1), V).float()
    drafts = torch.stack([torch.multinomial(q[j], S, replacement=True, generator=g) for j in range(K)], 1)
    got = verify_round(p, q, drafts, torch.Generator().manual_seed(seed + 1))
    want = ref.verify_tree(p, q, drafts, torch.Generator().manual_seed(seed + 1))
    assert got == want


def test_plugin_sampler_chi_square_and_acceptance():
    """3000 draws of the plugin's recursive rejection (2 siblings from a q far from p) fit p; the
    first candidate's acceptance rate is sum min(p, q) within 4 sigma. Control: emitting the first
    draft unverified (samples of q) fails the same test."""
    p, q = _dist(1, v=6), _dist(7, v=6, sharp=1.0)
    gen = torch.Generator().manual_seed(0)
    N, counts, raw, first_acc = 3000, torch.zeros(6), torch.zeros(6), 0
    for _ in range(N):
        cands = torch.multinomial(q, 2, replacement=True, generator=gen).tolist()
        tok, idx = verify_candidates(p, q, cands, gen)
        counts[tok] += 1
        raw[cands[0]] += 1
        first_acc += idx == 0
    assert chi2_pvalue(counts, p) > 1e-3
    assert chi2_pvalue(raw, p) < 1e-6  # the test has power against an unverified draft
    a = ref.expected_acceptance(p, q)
    assert abs(first_acc / N - a) < 4 * (a * (1 - a) / N) ** 0.5


@FAST
@given(seed=st.integers(0, 10**6), gamma=st.floats(0, 1), eta=st.floats(0, 5), rho=st.floats(0.01, 2))
def test_reflex_matches_reference_and_stays_in_ball(seed, gamma, eta, rho):
    g = torch.Generator().manual_seed(seed)
    w_u, q = torch.randn(V, 8, generator=g), _dist(seed)
    c = torch.zeros(8)
    for t in torch.randint(V, (5,), generator=g).tolist():
        c_ref = ref.reflex_update(c, w_u, t, q, gamma, eta, rho)
        c = reflex_step(c, w_u, t, q, gamma, eta, rho)
        assert torch.allclose(c, c_ref, atol=1e-6)
        assert float(c.norm()) <= rho * (1 + 1e-5)


# ------------------------------------------------------------------------------ on the engine
def _tiny_engine(seed: int = 0, vocab: int = V) -> EmbeddedEngine:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # a peaked target, so that the law is far from uniform
        model.lm_head.weight.mul_(8.0)
    return EmbeddedEngine(model, eos_token_ids=[])


@torch.no_grad()
def _law(engine, prompt) -> torch.Tensor:
    """The model's exact law [V * V] of two sampled tokens after ``prompt`` (temperature 1)."""
    first = torch.softmax(engine.model(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
    rows = [
        torch.softmax(engine.model(input_ids=torch.tensor([[*prompt, a]])).logits[0, -1], -1)
        for a in range(V)
    ]
    return torch.stack([first[a] * rows[a] for a in range(V)]).reshape(-1)


def _part(engine, **kw) -> SpecRollPart:
    part = SpecRollPart(engine, build_knobs(SpecRollKnobs, kw, "method"))
    with torch.no_grad():  # a drafter that disagrees with the target
        part.decoder.heads.weight.normal_(0, 2.0, generator=torch.Generator().manual_seed(5))
    return part


def _gen(engine, n, seed, max_new=2, temperature=1.0, prompt=(1, 2, 3)):
    sp = SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=seed)
    return asyncio.run(engine.generate(list(prompt), n=n, sampling=sp)).samples


def test_engine_output_law_and_logprobs():
    """100 two-token samples of the engine with the decoder (depth 1, 2 siblings) fit the model's
    exact law over the V^2 sequences; every logprob is the teacher-forced one; both accept and
    reject paths ran. Control: the drafter's own proposals do not fit."""
    eng = _tiny_engine()
    prompt = [1, 2, 3]
    law = _law(eng, prompt)
    part = _part(eng, depth=1, width=2)
    samples = _gen(eng, 100, seed=11)
    counts = torch.zeros(V * V)
    for s in samples:
        counts[s.token_ids[0] * V + s.token_ids[1]] += 1
    assert chi2_pvalue(counts, law) > 1e-3
    st_ = part.decoder.take_stats()
    assert 0 < st_["accepted"] < st_["rounds"]  # accepted and corrected drafts both occurred
    for s in samples[:20]:
        tf = teacher_forced_logprobs(eng.model, prompt, s.token_ids)
        assert torch.allclose(torch.tensor(s.logprobs), tf, atol=1e-5)
    # power: at this sample size the test rejects the law of another prompt
    assert chi2_pvalue(counts, _law(eng, [1, 2, 0])) < 1e-3
    part.close()
    assert eng.decoder is None


def test_greedy_equals_plain_and_reflex_resets_per_sample():
    """Temperature 0: the decoder's tokens are the plain loop's. Two requests with the same seed
    give the same samples (the Reflex state starts over with every sample), inside its bound."""
    eng = _tiny_engine(seed=1, vocab=6)
    plain = _gen(eng, 1, seed=0, max_new=10, temperature=0.0)
    part = _part(eng, depth=3, reflex_eta=5.0, reflex_rho=0.3)
    spec = _gen(eng, 1, seed=0, max_new=10, temperature=0.0)
    assert spec[0].token_ids == plain[0].token_ids
    assert torch.allclose(torch.tensor(spec[0].logprobs), torch.tensor(plain[0].logprobs), atol=1e-5)
    a, b = _gen(eng, 2, seed=4, max_new=6), _gen(eng, 2, seed=4, max_new=6)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert 0 < part.decoder.reflex_max_norm <= 0.3 * (1 + 1e-5)
    part.close()


def test_slow_path_retrains_heads_and_state_round_trips():
    """Acceptance below the threshold for `slow_patience` steps fine-tunes the heads (their loss
    on the buffer falls, acceptance rises); the state restores into a fresh part exactly."""
    eng = _tiny_engine(seed=2)
    part = _part(eng, depth=2, slow_threshold=10.0, slow_patience=2, slow_steps=40, slow_lr=0.05)
    res = []
    for step in range(3):
        _gen(eng, 6, seed=step, max_new=6)
        res.append(asyncio.run(part.process(None)).metrics)
    assert res[0]["specroll/slow_updates"] == 0 and res[1]["specroll/slow_updates"] == 1
    _gen(eng, 12, seed=9, max_new=6)
    after = part.decoder.take_stats()
    assert res[1]["specroll/slow_loss"] < 1.5
    assert after["accepted"] / after["rounds"] > res[0]["specroll/accept_len"]
    state = part.state_dict()
    part.close()
    fresh = SpecRollPart(eng, part.k)
    fresh.load_state_dict(state)
    for k, v in part.decoder.heads.state_dict().items():
        assert torch.equal(fresh.decoder.heads.state_dict()[k], v)
    assert fresh.ema == part.ema and len(fresh.decoder.buffer) == len(part.decoder.buffer)
    fresh.close()


def test_build_refuses_an_engine_without_a_decode_loop():
    class Ctx:
        rank0, engine = True, object()

    with pytest.raises(ValueError, match="rollout.engine: embedded"):
        build(Ctx(), SpecRollKnobs())
    with pytest.raises(ValueError, match="width=0"):
        build_knobs(SpecRollKnobs, {"width": 0}, "method")
