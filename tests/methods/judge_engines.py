"""Judge engines for the LLM-judged reward tests.

- ``tiny_embedded_judge``: the real embedded engine on the tiny random Qwen3 (real model, real
  tokenizer). Its replies are gibberish, so it exercises the malformed-output containment.
- ``ScriptedJudgeEngine``: a STAND-IN for an instruction-following judge model (a random tiny model
  cannot follow a rubric). It is a real ``RolloutEngine`` subclass going through the base class's
  validation, concurrency bound and abort logic; only ``_generate`` is scripted: it decodes the
  prompt ids with the real tokenizer and encodes the scripted reply.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from megarl.rollout.engine import RolloutEngine
from megarl.rollout.types import EngineDeadError, GenerateResult, Sample
from megarl.testing.tiny_qwen3 import find_tiny_qwen3_fixture


class TinyTokenizer:
    """The tiny-qwen3 fixture's real tokenizer through the ``tokenizers`` library (no transformers import)."""

    def __init__(self):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(find_tiny_qwen3_fixture() / "tokenizer.json"))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))

    def __len__(self) -> int:
        return self._tok.get_vocab_size()


def tiny_tokenizer() -> TinyTokenizer:
    return TinyTokenizer()


class ScriptedJudgeEngine(RolloutEngine):
    """``reply(prompt_text) -> str | Exception | ("sleep", seconds)``; see the module docstring."""

    def __init__(self, tokenizer, reply: Callable[[str], object]):
        super().__init__("scripted-judge", vocab_size=len(tokenizer))
        self.tok, self.reply = tokenizer, reply
        self.prompts: list[str] = []

    async def _generate(self, req) -> GenerateResult:
        text = self.tok.decode(req.prompt_ids)
        self.prompts.append(text)
        out = self.reply(text)
        if isinstance(out, tuple) and out[0] == "sleep":
            await asyncio.sleep(out[1])
            out = "score: 1"
        if isinstance(out, Exception):
            raise out
        ids = list(self.tok.encode(out, add_special_tokens=False))
        return GenerateResult(
            prompt_ids=list(req.prompt_ids),
            engine=self.name,
            request_id=req.request_id,
            samples=[Sample(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")],
        )

    async def update_weights(self, weights_dir, version=None) -> None:
        raise EngineDeadError("scripted judge has no weights")

    async def health(self) -> bool:
        return True


def tiny_embedded_judge(tmp_path):
    from megarl.rollout.embedded import EmbeddedEngine
    from megarl.testing.tiny_qwen3 import build_tiny_qwen3

    path = build_tiny_qwen3(tmp_path / "judge", seed=0, dtype="float32")
    return EmbeddedEngine.from_pretrained(path)
