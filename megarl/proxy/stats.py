"""Calibration data and per-expert statistics of a HF MoE model (transformers, CPU, float32).

Calibration text is tokenized with the checkpoint's own tokenizer, the token stream is packed into
sequences of ``seq_len`` and capped at ``max_tokens``. The model runs on it with a forward
pre-hook on every MoE block's ``experts`` module, which in transformers >= 5 is called as
``experts(x: [T, H], top_k_index: [T, k], top_k_weights: [T, k])`` by Qwen3-MoE, DeepSeek-V3 and
Mixtral alike. The hook records the routing; afterwards every expert is run on *all* captured
tokens through the same module (routing every token to expert ``e`` with weight 1), which gives
the output signatures independently of the routing.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np
import torch

from megarl.proxy.hf_expert_files import ProxyInputError

TEXT_FIELDS = ("text", "prompt")


def read_calibration_texts(calib: str | list[str]) -> list[str]:
    """Texts from a list of strings, a ``.jsonl`` file (field ``text``, else ``prompt`` plus an
    optional ``response``/``completion``), a ``.json`` list of strings, or a ``.txt`` file (one
    text per non-empty line). Errors name the file and row."""
    if isinstance(calib, (list, tuple)):
        texts = [t for t in calib if isinstance(t, str)]
        if len(texts) != len(calib):
            bad = next(i for i, t in enumerate(calib) if not isinstance(t, str))
            raise ProxyInputError(f"calibration list item {bad} is {type(calib[bad]).__name__}, not a string")
        where = "calibration list"
    else:
        path = os.fspath(calib)
        where = path
        if not os.path.isfile(path):
            raise ProxyInputError(f"calibration file {path}: not found")
        if path.endswith(".jsonl"):
            texts = []
            with open(path) as f:
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ProxyInputError(f"{path}: row {i} is not valid JSON ({e})") from None
                    field = next(
                        (k for k in TEXT_FIELDS if isinstance(row, dict) and isinstance(row.get(k), str)),
                        None,
                    )
                    if field is None:
                        raise ProxyInputError(
                            f"{path}: row {i} has no string field {' or '.join(TEXT_FIELDS)}"
                        )
                    text = row[field]
                    if field == "prompt":
                        text += next(
                            (row[k] for k in ("response", "completion") if isinstance(row.get(k), str)), ""
                        )
                    texts.append(text)
        elif path.endswith(".json"):
            with open(path) as fh:
                data = json.load(fh)
            if not isinstance(data, list) or not all(isinstance(t, str) for t in data):
                raise ProxyInputError(f"{path}: expected a JSON list of strings")
            texts = data
        elif path.endswith(".txt"):
            with open(path) as fh:
                texts = [ln.rstrip("\n") for ln in fh if ln.strip()]
        else:
            raise ProxyInputError(f"calibration file {path}: unknown format (use .jsonl, .json or .txt)")
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ProxyInputError(f"{where}: no calibration text (empty)")
    return texts


def tokenize_calibration(
    texts: list[str], tokenizer_dir: str, vocab_size: int, max_tokens: int, seq_len: int = 256
) -> list[torch.Tensor]:
    """Tokenize, pack into sequences of at most ``seq_len`` tokens, cap at ``max_tokens`` in all.

    Returns a list of ``[L]`` long tensors. Raises ``ProxyInputError`` when there is no tokenizer,
    nothing tokenizes, or a token id is outside the model's vocabulary.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as e:
        raise ProxyInputError(
            f"{tokenizer_dir}: no usable tokenizer ({type(e).__name__}: {str(e)[:200]})"
        ) from None
    if len(tok) < 2:
        raise ProxyInputError(
            f"{tokenizer_dir}: no usable tokenizer (vocabulary of {len(tok)} tokens; "
            "tokenizer.json / tokenizer_config.json missing?)"
        )
    stream: list[int] = []
    content = 0
    for t in texts:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        content += len(ids)
        stream.extend(ids)
        if tok.eos_token_id is not None:
            stream.append(int(tok.eos_token_id))
        if len(stream) >= max_tokens:
            break
    stream = stream[:max_tokens]
    if content == 0 or len(stream) < 2:
        raise ProxyInputError(
            f"calibration data tokenizes to {content} tokens with {tokenizer_dir}'s tokenizer"
        )
    bad = [i for i in stream if not 0 <= i < vocab_size]
    if bad:
        raise ProxyInputError(
            f"calibration token id {bad[0]} is outside the model's vocab_size={vocab_size} "
            f"(tokenizer of {tokenizer_dir} does not match config.json)"
        )
    ids = torch.tensor(stream, dtype=torch.long)
    return list(ids.split(seq_len))


@dataclass
class LayerStats:
    """Per-expert statistics of one MoE layer over ``tokens`` calibration tokens (E experts)."""

    layer: int
    tokens: int
    count: np.ndarray  # [E] tokens routed to e
    mass: np.ndarray  # [E] sum of e's gate weights over the tokens routed to it
    saliency: np.ndarray  # [E] mean over routed tokens of ||g_e(x) E_e(x)|| (0 if never routed)
    out_signature: np.ndarray  # [E, H] mean of E_e(x) over ALL calibration tokens
    router_rows: np.ndarray  # [E, H]
    topk: torch.Tensor  # [tokens, k] original routed expert ids
    gates: torch.Tensor  # [tokens, k] original gate weights

    @property
    def freq(self) -> np.ndarray:
        """[E] routing frequency: share of tokens routed to e."""
        return self.count / max(self.tokens, 1)

    @property
    def mean_gate(self) -> np.ndarray:
        """[E] mean gate weight over the tokens routed to e (0 if none)."""
        return np.where(self.count > 0, self.mass / np.maximum(self.count, 1), 0.0)


_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)$")


def find_moe_blocks(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """layer index -> MoE block (a module with ``gate`` and ``experts`` children)."""
    out = {}
    for name, mod in model.named_modules():
        m = _BLOCK.match(name)
        if m and hasattr(mod, "experts") and hasattr(mod, "gate"):
            out[int(m.group(1))] = mod
    return out


def expert_output(experts: torch.nn.Module, x: torch.Tensor, e: int) -> torch.Tensor:
    """E_e(x): [T, H] output of expert ``e`` on every row of ``x: [T, H]``, through the model's own
    experts module (all tokens routed to ``e`` with gate weight 1)."""
    idx = torch.full((x.shape[0], 1), e, dtype=torch.long)
    return experts(x, idx, torch.ones(x.shape[0], 1, dtype=x.dtype))


@torch.no_grad()
def collect_expert_stats(
    model: torch.nn.Module, sequences: list[torch.Tensor], layers: list[int]
) -> dict[int, LayerStats]:
    """Run ``model`` on ``sequences`` and gather ``LayerStats`` for every MoE layer in ``layers``."""
    blocks = find_moe_blocks(model)
    if sorted(blocks) != sorted(layers):
        raise ProxyInputError(
            f"MoE layers in the model {sorted(blocks)} differ from the checkpoint's {sorted(layers)}"
        )
    captured: dict[int, list] = {layer: [] for layer in layers}
    active = {"on": True}

    def hook_for(layer: int):
        def hook(mod, args, kwargs):
            if not active["on"]:
                return
            vals = list(args) + [
                kwargs[k] for k in ("hidden_states", "top_k_index", "top_k_weights") if k in kwargs
            ]
            x, idx, w = vals[:3]
            captured[layer].append(
                (x.detach().float().clone(), idx.detach().clone(), w.detach().float().clone())
            )

        return hook

    handles = [
        blocks[layer].experts.register_forward_pre_hook(hook_for(layer), with_kwargs=True) for layer in layers
    ]
    try:
        for seq in sequences:
            model(seq[None])
    finally:
        for h in handles:
            h.remove()
    active["on"] = False
    out: dict[int, LayerStats] = {}
    for layer in layers:
        experts = blocks[layer].experts
        E = int(blocks[layer].gate.weight.shape[0])
        x = torch.cat([c[0] for c in captured[layer]])
        idx = torch.cat([c[1] for c in captured[layer]])
        w = torch.cat([c[2] for c in captured[layer]])
        T, H = x.shape
        count = np.bincount(idx.reshape(-1).numpy(), minlength=E).astype(np.float64)
        mass = np.zeros(E)
        np.add.at(mass, idx.reshape(-1).numpy(), w.reshape(-1).double().numpy())
        sig = np.zeros((E, H))
        sal = np.zeros(E)
        for e in range(E):
            y = expert_output(experts, x, e).double()  # [T, H]
            sig[e] = y.mean(0).numpy()
            routed = idx == e
            tok = routed.any(-1)
            if tok.any():
                g = (w.double() * routed).sum(-1)[tok]  # [T_e]
                sal[e] = float((g * y[tok].norm(dim=-1)).mean())
        out[layer] = LayerStats(
            layer=layer,
            tokens=T,
            count=count,
            mass=mass,
            saliency=sal,
            out_signature=sig,
            router_rows=blocks[layer].gate.weight.detach().double().numpy().copy(),
            topk=idx,
            gates=w,
        )
    return out
