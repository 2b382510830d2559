"""SpecRoll's speculative decode loop for the embedded engine (reference/rollout.py, reconstructed).

Per sample: the target (the policy) samples a token from its own distribution ``p``; lightweight
future-token heads read the target's last-layer hidden state ``h`` (plus the Reflex correction
``c``) and propose the next ``depth`` tokens, ``width`` sibling candidates at the first position,
each drawn from the head's distribution ``q``. One target forward over the candidates verifies
them: a draft is accepted with probability ``min(1, p(x) / q(x))``, siblings by recursive
rejection, the first rejected position is drawn again from ``norm(max(0, p - q))``, and a bonus
token follows a fully accepted chain. Every emitted token is therefore distributed exactly as plain
sampling from ``p``, and its logprob is the target's own (from the verifying forward).
"""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace
from typing import Any

import torch

from megarl.rollout.embedded import _filter_logits
from megarl.rollout.types import EngineDeadError, GenerateRequest, Sample


def sampling_probs(logits: torch.Tensor, sp: Any) -> torch.Tensor:
    """The distribution [..., V] the engine samples from: one-hot argmax at temperature 0, else the
    softmax of the temperature-scaled logits inside top-k / top-p."""
    logits = logits.float()
    if sp.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    flat = logits.reshape(-1, logits.shape[-1]) / sp.temperature
    return torch.softmax(_filter_logits(flat, sp.top_k, sp.top_p), dim=-1).reshape(logits.shape)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = torch.clamp(p - q, min=0)
    s = float(r.sum())
    return p if s <= 0 else r / s


def verify_candidates(
    p: torch.Tensor, q: torch.Tensor, cands: list[int], gen: torch.Generator
) -> tuple[int, int]:
    """Recursive rejection of i.i.d. candidates from ``q`` against ``p``: (emitted token, index of
    the accepted candidate or -1). One uniform per candidate tried, one draw when all fail."""
    target = p
    for i, x in enumerate(cands):
        u = float(torch.rand(1, generator=gen))
        qx = float(q[x])
        if qx <= 0 or u < min(1.0, float(target[x]) / qx):
            return x, i
        target = _residual(target, q)
    return int(torch.multinomial(target, 1, generator=gen)), -1


def verify_round(
    p_rows: torch.Tensor, q_rows: torch.Tensor, drafts: torch.Tensor, gen: torch.Generator
) -> tuple[list[int], int]:
    """One round: p_rows [S, K+1, V], q_rows [K, V], drafts [S, K] -> (emitted tokens, sibling)."""
    K = drafts.shape[1]
    tok, sib = verify_candidates(p_rows[0, 0], q_rows[0], [int(x) for x in drafts[:, 0]], gen)
    if sib < 0:
        return [tok], 0
    out = [tok]
    for j in range(1, K):
        tok, got = verify_candidates(p_rows[sib, j], q_rows[j], [int(drafts[sib, j])], gen)
        out.append(tok)
        if got < 0:
            return out, sib
    out.append(int(torch.multinomial(p_rows[sib, K], 1, generator=gen)))
    return out, sib


def reflex_step(
    c: torch.Tensor, w_u: torch.Tensor, token: int, q: torch.Tensor, gamma: float, eta: float, rho: float
) -> torch.Tensor:
    """Reflex: ``c <- proj_{|c| <= rho}(gamma c + eta (W_u[token] - q @ W_u))`` (no gradients)."""
    c = gamma * c.double() + eta * (w_u[token].double() - q.double() @ w_u.double())
    n = float(c.norm())
    return (c * (rho / n) if n > rho else c).float()


class FutureHeads(torch.nn.Module):
    """``depth`` residual heads over the target's hidden state: head k maps ``h`` to
    ``h + silu(A_k h + b_k)``, read out by the target's own unembedding (zero init: every head
    starts as the target's next-token distribution)."""

    def __init__(self, hidden: int, depth: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(depth, hidden, hidden))
        self.bias = torch.nn.Parameter(torch.zeros(depth, hidden))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> [..., depth, H]."""
        z = torch.einsum("...h,kgh->...kg", h, self.weight) + self.bias
        return h.unsqueeze(-2) + torch.nn.functional.silu(z)


class SpeculativeDecoder:
    """The ``Decoder`` the SpecRoll part installs in the embedded engine (see the module docstring).

    Counters since the last ``take_stats()``: samples, target forwards (a request's shared prefill
    counts once per sample), verify rounds, drafts proposed/accepted, tokens. ``buffer`` keeps the
    last ``buffer_size`` (hidden state, depth, token the target emitted there) triples for the
    slow path."""

    def __init__(self, hidden: int, knobs: Any):
        self.k = knobs
        self.heads = FutureHeads(hidden, knobs.depth)
        self.lock = threading.Lock()
        self.buffer: list[tuple[torch.Tensor, int, int]] = []
        self.stats = dict.fromkeys(("samples", "forwards", "rounds", "drafted", "accepted", "tokens"), 0)
        self.reflex_max_norm = 0.0

    def plan(self, load: int) -> tuple[int, int]:
        """(depth, width) for ``load`` samples decoding together: the full tree up to
        ``concurrency_full`` samples, then shallower and one candidate wide."""
        k = self.k
        if load <= k.concurrency_full:
            return k.depth, k.width
        return max(1, (k.depth * k.concurrency_full) // load), 1

    def take_stats(self) -> dict[str, int]:
        """The counters since the last call (reset)."""
        out = dict(self.stats)
        self.stats = dict.fromkeys(self.stats, 0)
        return out

    @torch.no_grad()
    def decode(
        self, engine: Any, req: GenerateRequest, gen: torch.Generator, stop_ids: set[int], abort
    ) -> list[Sample]:
        """The request's ``n`` samples, one after another, each from the shared prefill."""
        with self.lock:
            model = engine.model
            w_u = model.get_output_embeddings().weight.detach().float()
            out = model(
                input_ids=torch.tensor([list(req.prompt_ids)]), use_cache=True, output_hidden_states=True
            )
            cache = next(iter(engine._cache_kw(out).values()))
            depth, width = self.plan(req.n)
            first = (out.logits[0, -1].float(), out.hidden_states[-1][0, -1].float())
            return [
                self._one(engine, req, gen, stop_ids, abort, copy.deepcopy(cache), first, w_u, depth, width)
                for _ in range(req.n)
            ]

    def _one(self, engine, req, gen, stop_ids, abort, cache, first, w_u, depth, width) -> Sample:
        sp, model, k = req.sampling, engine.model, self.k
        logits, h = first
        tokens: list[int] = []
        logprobs: list[float] = []
        finish, reason = None, None

        def emit(tok: int, row: torch.Tensor) -> bool:
            nonlocal finish, reason
            tokens.append(tok)
            logprobs.append(float(torch.log_softmax(row, -1)[tok]))
            hit = engine.stop_hit(tokens, stop_ids, sp)
            if hit is not None:
                finish, reason = "stop", hit[0]
            elif len(tokens) >= sp.max_new_tokens:
                finish = "length"
            return finish is not None

        c = torch.zeros_like(h)  # Reflex correction, reset per sample
        self.stats["samples"] += 1
        self.stats["forwards"] += 1
        x = int(torch.multinomial(sampling_probs(logits, sp), 1, generator=gen))
        done = emit(x, logits)
        while not done:
            if engine.dead_reason is not None:
                raise EngineDeadError(
                    f"{engine.name}: engine shut down during generation ({engine.dead_reason})"
                )
            if abort.is_set():
                finish = "abort"
                break
            K = min(depth, sp.max_new_tokens - len(tokens))
            q_rows = sampling_probs(self.heads(h + c)[:K] @ w_u.T, sp)  # [K, V]
            S = width
            drafts = torch.tensor(
                [[int(torch.multinomial(q_rows[j], 1, generator=gen)) for j in range(K)] for _ in range(S)]
            )
            past = cache.get_seq_length()
            if S > 1:
                cache.batch_repeat_interleave(S)
            feed = torch.cat([torch.full((S, 1), x), drafts], 1)
            o = model(input_ids=feed, use_cache=True, output_hidden_states=True, **_cache_arg(engine, cache))
            rows = o.logits.float()  # [S, K+1, V]
            emitted, sib = verify_round(sampling_probs(rows, sp), q_rows, drafts, gen)
            m = len(emitted) - 1
            if S > 1:
                cache.batch_select_indices(torch.tensor([sib]))
            extra = cache.get_seq_length() - (past + 1 + m)  # rejected drafts' positions
            if extra > 0:
                cache.crop(-extra)  # a negative count removes that many in every transformers release
            self.stats["forwards"] += 1
            self.stats["rounds"] += 1
            self.stats["drafted"] += K * S
            self.stats["accepted"] += m
            for j, t in enumerate(emitted[:K]):  # depth K (the bonus token) has no head
                self.buffer.append((h.clone(), j, t))
            if len(self.buffer) > k.buffer_size:
                del self.buffer[: len(self.buffer) - k.buffer_size]
            c = reflex_step(c, w_u, emitted[0], q_rows[0], k.reflex_gamma, k.reflex_eta, k.reflex_rho)
            self.reflex_max_norm = max(self.reflex_max_norm, float(c.norm()))
            for j, t in enumerate(emitted):
                if emit(t, rows[sib, j]):
                    done = True
                    break
            x, h = emitted[-1], o.hidden_states[-1][sib, m].float()
        self.stats["tokens"] += len(tokens)
        return Sample(
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=finish or "length",
            weight_version=engine.weight_version,
            stop_reason=reason,
        )

    def train_heads(self, w_u: torch.Tensor) -> float:
        """The slow path: ``slow_steps`` Adam steps of cross-entropy of each head on the buffered
        (hidden state, depth, emitted token) triples; returns the last loss."""
        with self.lock:
            if not self.buffer:
                return float("nan")
            hs = torch.stack([b[0] for b in self.buffer])
            depth = torch.tensor([b[1] for b in self.buffer])
            tok = torch.tensor([b[2] for b in self.buffer])
            opt = torch.optim.Adam(self.heads.parameters(), lr=self.k.slow_lr)
            loss = torch.tensor(float("nan"))
            w = w_u.detach().float()
            for _ in range(self.k.slow_steps):
                with torch.enable_grad():
                    z = self.heads(hs)[torch.arange(len(tok)), depth]  # [N, H]
                    loss = torch.nn.functional.cross_entropy(z @ w.T, tok)
                    opt.zero_grad()
                    loss.backward()
                opt.step()
            return float(loss.detach())


def _cache_arg(engine: Any, cache: Any) -> dict:
    """The cache keyword of ``engine.model`` (named per transformers release)."""
    return engine._cache_kw(SimpleNamespace(cache=cache))
