"""A scripted rollout engine for the reflection tests: a real ``RolloutEngine`` subclass (request
validation, concurrency bound) whose ``_generate`` answers ``reply(prompt_text, seed)`` encoded with
megarl's char tokenizer, logprob -0.5 per token. A STAND-IN for a model that can reflect; it records
every prompt it was sent."""

from __future__ import annotations

from collections.abc import Callable

from megarl.data.tokenizer import CharTokenizer
from megarl.rollout.engine import RolloutEngine
from megarl.rollout.types import EngineDeadError, GenerateResult, Sample

ALPHABET = "0123456789 abcdefghijklmnopqrstuvwxyz:.?!,\n+-=<>"


def char_tokenizer() -> CharTokenizer:
    """The tests' char tokenizer."""
    return CharTokenizer(ALPHABET)


class ScriptedEngine(RolloutEngine):
    """See the module docstring."""

    def __init__(self, tok: CharTokenizer, reply: Callable[[str, int], str]):
        super().__init__("scripted", vocab_size=tok.vocab_size)
        self.tok, self.reply = tok, reply
        self.prompts: list[str] = []

    async def _generate(self, req) -> GenerateResult:
        text = self.tok.decode(list(req.prompt_ids))
        samples = []
        for j in range(req.n):
            self.prompts.append(text)
            ids = self.tok.encode(self.reply(text, (req.sampling.seed or 0) + j), bos=False)
            ids = ids[: req.sampling.max_new_tokens]
            samples.append(Sample(ids, [-0.5] * len(ids), "stop", weight_version=self.weight_version))
        return GenerateResult(list(req.prompt_ids), samples, self.name, req.request_id)

    async def update_weights(self, weights_dir, version=None) -> None:
        raise EngineDeadError("the scripted engine has no weights")

    async def health(self) -> bool:
        return True
