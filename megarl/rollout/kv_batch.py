"""A left-padded KV-cache batch: the decode state of every in-flight row of the embedded engine.

Rows of different lengths share one Hugging Face cache whose layers hold ``[B, H, L, D]`` keys and
values, each row left-padded to the longest one; a ``[B, L]`` mask marks the real positions and
every row carries its own next position id. A prefilled request joins with ``join`` (its cache is
padded to the batch, or the batch to it), finished rows leave with ``keep`` (columns that only
padding uses are trimmed), and ``step`` decodes one token for every row in one forward.

When every row has the same length no mask is passed, so a batch of one request runs exactly the
forward of an unbatched decode loop.
"""

from __future__ import annotations

from typing import Any

import torch


def cache_layers(cache: Any) -> list[Any] | None:
    """The layers of an HF cache when each holds plain ``keys`` / ``values`` tensors that grow by
    concatenation (the dynamic cache), else None (such a cache cannot be padded and merged)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in layers):
        return None
    return list(layers)


def output_cache(out: Any) -> Any:
    """The KV cache of a model output (transformers >= 5.2x names it ``cache``; older releases
    ``past_key_values``)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _pad_left(t: torch.Tensor, cols: int) -> torch.Tensor:
    if cols == 0:
        return t
    pad = t.new_zeros(*t.shape[:-2], cols, t.shape[-1])
    return torch.cat([pad, t], dim=-2)


class KVBatch:
    """The padded decode state of the in-flight rows.

    Args:
      model: the causal LM (called as ``model(input_ids=..., position_ids=..., attention_mask=...,
        use_cache=True, <cache_arg>=cache)``).
      cache_arg: the keyword the model's forward takes the cache by.
    """

    def __init__(self, model: torch.nn.Module, cache_arg: str):
        self.model = model
        self.cache_arg = cache_arg
        self.cache: Any = None
        self.mask = torch.zeros(0, 0, dtype=torch.bool)  # [B, L]: True at real positions
        self.pos = torch.zeros(0, dtype=torch.long)  # [B]: the position id of each row's next token

    @property
    def rows(self) -> int:
        """Rows in the batch."""
        return int(self.pos.shape[0])

    def join(self, cache: Any, n: int, length: int) -> None:
        """Append the ``n`` rows of a prefilled cache (every row ``length`` real tokens, no
        padding). Any cache can start an empty batch; only a dynamic one can join rows."""
        if self.cache is None:
            self.cache = cache
            self.mask = torch.ones(n, length, dtype=torch.bool)
            self.pos = torch.full((n,), length, dtype=torch.long)
            return
        mine, layers = cache_layers(self.cache), cache_layers(cache)
        if mine is None or layers is None:
            raise ValueError("only dynamic (concatenating) KV caches can share a batch")
        L = int(self.mask.shape[1])
        width = max(L, length)
        for own, new in zip(mine, layers, strict=True):
            own.keys = torch.cat([_pad_left(own.keys, width - L), _pad_left(new.keys, width - length)], 0)
            own.values = torch.cat(
                [_pad_left(own.values, width - L), _pad_left(new.values, width - length)], 0
            )
        new_mask = torch.zeros(n, width, dtype=torch.bool)
        new_mask[:, width - length :] = True
        self.mask = torch.cat([torch.nn.functional.pad(self.mask, (width - L, 0)), new_mask], 0)
        self.pos = torch.cat([self.pos, torch.full((n,), length, dtype=torch.long)])

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in this order); trim the leading columns no kept row uses."""
        if not rows:
            self.cache, self.mask, self.pos = None, self.mask[:0, :0], self.pos[:0]
            return
        if rows == list(range(self.rows)):
            return
        idx = torch.tensor(rows, dtype=torch.long)
        mask = self.mask[idx]
        start = int(mask.any(0).int().argmax())  # first column a kept row uses
        layers = cache_layers(self.cache)
        assert layers is not None
        for layer in layers:
            layer.keys = layer.keys[idx, :, start:].contiguous()
            layer.values = layer.values[idx, :, start:].contiguous()
        self.mask, self.pos = mask[:, start:].contiguous(), self.pos[idx]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([B] long); returns the next-token logits [B, V] in fp32."""
        mask = torch.cat([self.mask, torch.ones(self.rows, 1, dtype=torch.bool)], 1)
        out = self.model(
            input_ids=tokens.unsqueeze(-1),
            position_ids=self.pos.unsqueeze(-1),
            attention_mask=None if bool(mask.all()) else mask.long(),
            use_cache=True,
            **{self.cache_arg: self.cache},
        )
        self.cache = output_cache(out)
        self.mask, self.pos = mask, self.pos + 1
        return out.logits[:, -1, :].float()
