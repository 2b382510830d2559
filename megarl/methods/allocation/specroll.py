"""SpecRoll: speculative rollouts with adaptive future-token heads (reconstructed from the abstract;
the sampler is standard speculative sampling, reference/rollout.py).

The method installs a ``SpeculativeDecoder`` (specroll_decode.py) in the run's embedded engine:
every rollout sample is produced by drafting with the heads and verifying with the policy, so the
samples and their logprobs are the policy's own (lossless). A round processor keeps the drafter
adapting as the policy trains: each step it folds the step's acceptance length (accepted drafts
per verify round) into an EMA; after ``slow_patience`` steps in a row below ``slow_threshold`` the
slow path fine-tunes the heads on the buffered (hidden state, token) pairs. The Reflex fast path
(a bounded per-sample correction of the heads' input) runs inside the decoder.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from megarl.methods.allocation.specroll_decode import SpeculativeDecoder
from megarl.plugin.knobs import Knobs
from megarl.plugin.rounds import RolloutRound, RoundResult
from megarl.plugin.spec import MethodParts, MethodSpec


@dataclass
class SpecRollKnobs(Knobs):
    """Draft tree, Reflex and slow-path knobs (``method`` section)."""

    depth: int = 3  # drafted tokens per verify round (future-token heads)
    width: int = 1  # sibling candidates at the first drafted position (1: a chain)
    concurrency_full: int = 64  # up to this many samples per request: the full tree; more: shallower, width 1
    reflex_gamma: float = 0.5  # decay of the Reflex correction per round
    reflex_eta: float = 0.05  # step toward the accepted token's unembedding
    reflex_rho: float = 1.0  # bound on the correction's norm
    slow_threshold: float = 1.0  # EMA accepted drafts per round below which a step counts as degraded
    slow_patience: int = 2  # degraded steps in a row before the heads are fine-tuned
    slow_steps: int = 50  # Adam steps per slow-path update
    slow_lr: float = 1.0e-3
    ema: float = 0.5  # weight of the old EMA per step
    buffer_size: int = 4096  # (hidden state, token) pairs kept for the slow path

    def check(self) -> None:
        """Positive depth/width/sizes; gamma, ema in [0, 1]; eta, rho, lr >= 0."""
        for key in ("depth", "width", "concurrency_full", "slow_patience", "buffer_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        for key in ("reflex_gamma", "ema"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"{key}={getattr(self, key)} must be in [0, 1]")
        for key in ("reflex_eta", "reflex_rho", "slow_lr", "slow_steps", "slow_threshold"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 0")


class SpecRollPart:
    """Rank 0's round processor: installs the decoder, reports its counters, runs the slow path;
    its state (heads, EMA, buffer) goes in checkpoints. ``close()`` puts the engine's previous
    decode loop back."""

    def __init__(self, engine: Any, knobs: SpecRollKnobs):
        self.engine, self.k = engine, knobs
        hidden = int(engine.model.get_output_embeddings().weight.shape[1])
        self.decoder = SpeculativeDecoder(hidden, knobs)
        self.previous = engine.install_decoder(self.decoder)
        self.ema: float | None = None
        self.low = 0  # degraded steps in a row
        self.slow_updates = 0
        self.totals = {"forwards": 0, "tokens": 0}

    async def process(self, r: RolloutRound) -> RoundResult:
        """The round's speculative counters as metrics; the slow path when acceptance stays low."""
        st = self.decoder.take_stats()
        m = {
            "specroll/tokens_per_forward": st["tokens"] / max(st["forwards"], 1),
            "specroll/accept_rate": st["accepted"] / max(st["drafted"], 1),
            "specroll/accept_len": st["accepted"] / max(st["rounds"], 1),
            "specroll/forwards": float(st["forwards"]),
            "specroll/reflex_max_norm": self.decoder.reflex_max_norm,
        }
        self.totals = {k: self.totals[k] + st[k] for k in self.totals}
        if st["rounds"]:
            a = m["specroll/accept_len"]
            self.ema = a if self.ema is None else self.k.ema * self.ema + (1 - self.k.ema) * a
            self.low = self.low + 1 if self.ema < self.k.slow_threshold else 0
        if self.low >= self.k.slow_patience:
            w_u = self.engine.model.get_output_embeddings().weight
            m["specroll/slow_loss"] = await asyncio.to_thread(self.decoder.train_heads, w_u)
            self.slow_updates += 1
            self.low = 0
        m["specroll/accept_len_ema"] = float(self.ema or 0.0)
        m["specroll/slow_updates"] = float(self.slow_updates)
        m["specroll/tokens_per_forward_total"] = self.totals["tokens"] / max(self.totals["forwards"], 1)
        return RoundResult(metrics=m)

    def state_dict(self) -> dict:
        """Heads, EMA, counters and the slow-path buffer."""
        return {
            "heads": {k: v.detach().clone() for k, v in self.decoder.heads.state_dict().items()},
            "ema": self.ema,
            "low": self.low,
            "slow_updates": self.slow_updates,
            "totals": dict(self.totals),
            "buffer": [(h.clone(), j, t) for h, j, t in self.decoder.buffer],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``."""
        with self.decoder.lock:
            self.decoder.heads.load_state_dict(state["heads"])
            self.decoder.buffer = [(torch.as_tensor(h), int(j), int(t)) for h, j, t in state["buffer"]]
        self.ema, self.low = state["ema"], state["low"]
        self.slow_updates, self.totals = state["slow_updates"], dict(state["totals"])

    def close(self) -> None:
        """Give the engine its previous decode loop back."""
        if self.engine.decoder is self.decoder:
            self.engine.install_decoder(self.previous)


def build(ctx: Any, knobs: SpecRollKnobs) -> MethodParts:
    """Rank 0: the part over the run's engine, which must be the embedded one."""
    if not ctx.rank0:
        return MethodParts()
    if not callable(getattr(ctx.engine, "install_decoder", None)):
        raise ValueError(
            f"method specroll decodes speculatively inside the rollout engine: it needs rollout.engine: "
            f"embedded (this run's engine is {type(getattr(ctx.engine, 'inner', ctx.engine)).__name__})"
        )
    return MethodParts(round_processors=[SpecRollPart(ctx.engine, knobs)])


SPEC = MethodSpec(
    name="specroll",
    summary="lossless speculative rollouts: future-token heads draft, the policy verifies; heads adapt",
    provenance="reconstructed",
    knobs=SpecRollKnobs,
    build=build,
)
