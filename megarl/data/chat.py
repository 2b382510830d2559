"""Chat templates: a dataset prompt rendered as a user turn with the tokenizer's own template."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megarl.data.dataset import DataError


def chat_renderer(tokenizer: Any, system_prompt: str | None = None) -> Callable[[str], str]:
    """``render(text) -> prompt text``: ``text`` as the user message (after an optional system
    message), formatted by ``tokenizer.apply_chat_template`` with the assistant turn opened.

    ``tokenizer``: a transformers tokenizer, or a wrapper holding one in ``.tok``. Raises
    ``DataError`` when it has no chat template.
    """
    hf = getattr(tokenizer, "tok", tokenizer)
    if not getattr(hf, "chat_template", None):
        raise DataError(
            "data.chat_template=true but the model's tokenizer has no chat template "
            "(tokenizer_config.json chat_template or chat_template.jinja)"
        )

    def render(text: str) -> str:
        msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
        msgs.append({"role": "user", "content": text})
        return hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    return render
