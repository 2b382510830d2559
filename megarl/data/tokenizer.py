"""A character tokenizer for models built in the run (the quickstart has no model hub).

Ids: 0 ``<pad>``, 1 ``<eos>``, 2 ``<bos>``, then one id per character of ``alphabet``. The vocabulary
is padded up to a multiple of ``pad_to`` (so tensor parallelism can split it); padding ids never
decode to text.
"""

from __future__ import annotations

PAD, EOS, BOS = 0, 1, 2
_SPECIAL = 3


class CharTokenizer:
    """Maps each character of ``alphabet`` to one id; ``encode`` raises on a character outside it."""

    def __init__(self, alphabet: str, pad_to: int = 8):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet {alphabet!r} repeats a character")
        self.alphabet = alphabet
        self._ids = {c: i + _SPECIAL for i, c in enumerate(alphabet)}
        n = len(alphabet) + _SPECIAL
        self.vocab_size = -(-n // pad_to) * pad_to
        self.pad_id, self.eos_id, self.bos_id = PAD, EOS, BOS

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """``text`` -> ids (with a leading ``<bos>``)."""
        out = [BOS] if bos else []
        for i, c in enumerate(text):
            if c not in self._ids:
                raise ValueError(
                    f"character {c!r} at position {i} of {text!r} is not in the alphabet {self.alphabet!r}"
                )
            out.append(self._ids[c])
        return out

    def decode(self, ids: list[int]) -> str:
        """ids -> text, stopping at the first ``<eos>``; special and padding ids are dropped."""
        chars = []
        for t in ids:
            if t == EOS:
                break
            j = int(t) - _SPECIAL
            if 0 <= j < len(self.alphabet):
                chars.append(self.alphabet[j])
        return "".join(chars)
