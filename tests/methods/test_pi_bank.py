"""The turn-credit methods' context inputs: the PI bank (verified successes, never the sample's own,
bounded, checkpointed), the hindsight context (the trajectory's own outcome), and the learner pass
that reads them with the policy (a real tiny causal LM)."""

import asyncio
import math

import pytest
import torch

from megarl.batch import from_sequences
from megarl.data.tokenizer import CharTokenizer
from megarl.methods.agents.context_pass import ContextLogprobs
from megarl.methods.agents.hindsight import HindsightContext, HindsightKnobs
from megarl.methods.agents.pi_bank import PIBank, PIBankKnobs
from megarl.plugin.rounds import RolloutRound
from tests.methods.test_self_teacher import TinyCausalLM

TOK = CharTokenizer("0123456789+=RC ")


def _round(uids, responses, correct, texts=None, n=2):
    G = len(uids)
    return RolloutRound(
        prompts=["R 12="] * G,
        answers=["21"] * G,
        uids=uids,
        prompt_ids=[[1, 2]] * G,
        response_ids=responses,
        texts=texts or ["21"] * len(responses),
        dims={},
        scalar=torch.tensor([float(c) for c in correct]),
        n=n,
        step=0,
        round=0,
        correct=torch.tensor(correct),
    )


def _ids(row):
    return [int(x) for x in row if not math.isnan(x)]


def test_bank_gives_a_verified_success_never_the_samples_own_and_keeps_the_shortest():
    bank = PIBank(TOK, PIBankKnobs(capacity=2, max_tokens=6))
    res = asyncio.run(bank.process(_round([7], [[3, 4, 5], [6]], [True, False])))
    rows = res.extras["pi_context"]
    assert _ids(rows[0]) == [] and _ids(rows[1]) == [3, 4, 5]  # its own success is not its PI
    assert bank.entries[7] == [3, 4, 5]
    res = asyncio.run(bank.process(_round([7], [[9], [8, 8]], [False, True])))
    rows = res.extras["pi_context"]
    assert _ids(rows[0]) == [8, 8] and _ids(rows[1]) == [3, 4, 5]  # shorter sibling; else the bank
    assert res.metrics["pi_bank/from_bank_frac"] == 0.5 and bank.entries[7] == [8, 8]
    res = asyncio.run(bank.process(_round([7], [[1], [2]], [False, False])))
    assert [_ids(r) for r in res.extras["pi_context"]] == [[8, 8], [8, 8]]  # no success now: the bank's


def test_bank_is_bounded_checkpointed_and_skips_rows_that_do_not_fit():
    bank = PIBank(TOK, PIBankKnobs(capacity=2, max_tokens=4, prefix="C"))
    asyncio.run(bank.process(_round([1, 2, 3], [[5]] * 6, [True, False] * 3)))
    assert list(bank.entries) == [2, 3]  # capacity 2: the least recently used prompt went first
    res = asyncio.run(bank.process(_round([2], [[5, 5, 5, 5], [6]], [True, False])))
    assert res.metrics["pi_bank/too_long"] == 1.0  # 4 ids + the prefix do not fit a row of 4
    assert _ids(res.extras["pi_context"][1]) == [TOK.encode("C", bos=False)[0], 5]  # prefix + the bank's
    state = bank.state_dict()
    again = PIBank(TOK, PIBankKnobs(capacity=2, max_tokens=4, prefix="C"))
    again.load_state_dict(state)
    assert again.entries == bank.entries and list(again.entries) == list(bank.entries)
    with pytest.raises(ValueError, match="correctness check"):
        r = _round([1], [[5], [6]], [True, False])
        r.correct = None
        asyncio.run(bank.process(r))


def test_hindsight_rows_hold_the_trajectorys_own_outcome_and_verdict():
    knobs = HindsightKnobs(template="{verdict}{outcome}=", success="1", failure="0", max_tokens=8)
    res = asyncio.run(
        HindsightContext(TOK, knobs).process(_round([4], [[1], [2]], [True, False], ["21", "13"]))
    )
    got = [TOK.decode(_ids(r)) for r in res.extras["hindsight_context"]]
    assert got == ["121=", "013="]
    with pytest.raises(ValueError, match="verdict"):
        HindsightKnobs(template="{answer}").check()
    r = _round([4], [[1], [2]], [True, False])
    r.correct = None
    with pytest.raises(ValueError, match="correctness check"):
        asyncio.run(HindsightContext(TOK, knobs).process(r))


def test_context_pass_is_the_policy_reading_the_row_after_the_prompt():
    model = TinyCausalLM()
    b = from_sequences([[1, 2], [3]], [[4, 5], [6, 7, 8]], [0, 0])
    b.extras["pi_context"] = torch.tensor([[9.0, 10.0], [math.nan, math.nan]])
    ContextLogprobs(model, "pi_context", "pi_logprobs", "pi_on").fill(b, 2)
    full = model.logprobs([1, 2, 9, 10, 4, 5])
    want = torch.cat([full[:2], full[4:]]).float()
    torch.testing.assert_close(b.token_extras["pi_logprobs"][:4], want, rtol=0, atol=0)
    assert b.extras["pi_on"].tolist() == [1.0, 0.0] and bool((b.token_extras["pi_logprobs"][4:] == 0).all())
    del b.extras["pi_context"]
    with pytest.raises(ValueError, match="pi_context"):
        ContextLogprobs(model, "pi_context", "pi_logprobs", "pi_on").fill(b, 1)
