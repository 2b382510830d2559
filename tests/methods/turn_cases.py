"""Multi-turn equivalence cases for the turn-credit methods (TASPO, AgentOPSD, TRIAL): an
``rl_cases`` case whose responses are cut into assistant turns and (masked) observations, with a
privileged-context logprob per token, and the padded reference's view of it."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from megarl.batch import PackedBatch, unpack
from megarl.testing.equivalence import Case
from reference.aggregation import aggregate
from reference.logprobs import token_logprobs
from reference.policy_losses import ppo_clip
from tests.methods.trust_regions_harness import reference_method_loss_and_grad


def cut_turns(b: PackedBatch, rng: torch.Generator) -> list[list[tuple[int, int]]]:
    """Cut each response into alternating assistant turns and one-token observations (masked out);
    sets ``turn_spans`` and returns the assistant (start, end) spans per sequence."""
    spans, turns = [], []
    mask = b.loss_mask.clone()
    for i in range(b.num_seqs):
        start, p, n = int(b.cu_seqlens[i]), int(b.prompt_lens[i]), int(b.seq_lens[i])
        sp, tu, pos = [(0, p, "prompt")], [], p
        while pos < n:
            a = int(torch.randint(1, 4, (1,), generator=rng))
            e = min(n, pos + a)
            sp.append((pos, e, "assistant"))
            tu.append((pos, e))
            pos = e
            if pos < n and bool(torch.rand(1, generator=rng) < 0.7):
                sp.append((pos, pos + 1, "observation"))
                mask[start + pos] = 0.0
                pos += 1
        spans.append(sp)
        turns.append(tu)
    b.turn_spans = spans
    b.loss_mask = mask
    b.advantages = b.advantages * mask.to(b.advantages.dtype)
    return turns


@st.composite
def turn_cases(draw, cases):
    """(case with turns and ``privileged`` [T] logprobs in ``case.extra``, assistant turns)."""
    case = draw(cases)
    b = dataclasses.replace(case.batch, extras=dict(case.batch.extras), token_extras={})
    rng = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    turns = cut_turns(b, rng)
    spread = draw(st.sampled_from([0.3, 2.0]))
    priv = torch.clamp(
        b.old_logprobs + spread * torch.randn(b.num_tokens, generator=rng, dtype=b.old_logprobs.dtype), max=0
    )
    on = (torch.rand(b.num_seqs, generator=rng) < 0.8).double()
    extra = dict(case.extra, privileged=priv, on=on, rng=rng)
    return dataclasses.replace(case, batch=b.validate(), extra=extra), turns


def padded(b: PackedBatch, x: torch.Tensor) -> torch.Tensor:
    """A packed [T] tensor as [B, L] (0-padded)."""
    am = unpack(b).attention_mask
    out = torch.zeros(am.shape, dtype=x.dtype)
    out[am] = x
    return out


def privileged_padded(case: Case) -> torch.Tensor:
    """[B, L] the privileged logprobs where the sequence has a context, the own ones elsewhere."""
    b = case.batch
    own = case.extra["privileged"] * 0 + b.old_logprobs
    mixed = torch.where(case.extra["on"].bool()[b.seq_index()], case.extra["privileged"], own)
    return padded(b, mixed)


def ppo_reference(case: Case, adv_fn):
    """Reference (loss, grad) of PPO-clip with advantages ``adv_fn(pad) -> [B, L]``."""
    cfg = case.cfg

    def fn(full, pad):
        old = pad.per_token["old_logprobs"]
        logp = token_logprobs(full, pad.tokens)
        adv = adv_fn(pad).to(logp.dtype)
        return aggregate(
            ppo_clip(logp, old, adv, cfg.clip_low, cfg.clip_high), pad.loss_mask, cfg.aggregation
        )

    return reference_method_loss_and_grad(case, fn)
