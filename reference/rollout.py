"""Rollout acceleration (method family 6): speculative sampling as plain functions.

SpecRoll (reconstructed from its abstract and standard speculative sampling): a draft token
``x ~ q`` is accepted with probability ``min(1, p(x) / q(x))``; on a reject the token is drawn from
``norm(max(0, p - q))``. Sibling candidates (a draft tree's first level) are verified by recursive
rejection: each rejected candidate's ``q`` is taken off the running target before the next sibling
is tried. Either way the emitted token is distributed exactly as ``p``.

Randomness is drawn from a ``torch.Generator`` in a fixed order (per draft: one uniform; per
correction: one ``multinomial`` draw) so that an implementation consuming the same generator in
the same order returns the same tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` [V]; ``p`` itself when the difference has no mass (p == q)."""
    r = (p - q).clamp(min=0)
    s = r.sum()
    return p if float(s) <= 0 else r / s


def accept_prob(p: torch.Tensor, q: torch.Tensor, x: int) -> float:
    """``min(1, p(x) / q(x))`` (1 where q(x) == 0: such a draft is never proposed)."""
    qx = float(q[x])
    return 1.0 if qx <= 0 else min(1.0, float(p[x]) / qx)


def expected_acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """The chance a single draft from ``q`` is accepted against ``p``: ``sum_x min(p(x), q(x))``."""
    return float(torch.minimum(p, q).sum())


def verify_siblings(
    p: torch.Tensor, q: torch.Tensor, candidates: Sequence[int], gen: torch.Generator
) -> tuple[int, int]:
    """Recursive rejection over i.i.d. sibling candidates from ``q``: (the emitted token, the index
    of the accepted candidate or -1 when every one was rejected and the token was drawn from the
    final residual)."""
    target = p
    for i, x in enumerate(candidates):
        u = float(torch.rand(1, generator=gen))
        if u < accept_prob(target, q, x):
            return int(x), i
        target = residual(target, q)
    return int(torch.multinomial(target, 1, generator=gen)), -1


def verify_tree(
    p_rows: torch.Tensor, q_rows: torch.Tensor, drafts: torch.Tensor, gen: torch.Generator
) -> tuple[list[int], int]:
    """One speculative round over a draft tree: ``S`` sibling candidates at the first position, each
    continuing with its own chain down to depth K (S = 1: a plain chain).

    p_rows: [S, K + 1, V] the target's sampling distributions along each sibling's chain (row j
    scores the token at depth j, row K the bonus token; row 0 is the same for every sibling);
    q_rows: [K, V] the drafter's distribution at each depth (the same for every sibling);
    drafts: [S, K] token ids. Returns (the emitted tokens: the accepted drafts then one corrected
    or bonus token; the accepted sibling, 0 when every sibling was rejected).
    """
    K = drafts.shape[1]
    tok, sib = verify_siblings(p_rows[0, 0], q_rows[0], drafts[:, 0].tolist(), gen)
    out = [tok]
    if sib < 0:
        return out, 0
    for j in range(1, K):
        tok, got = verify_siblings(p_rows[sib, j], q_rows[j], [int(drafts[sib, j])], gen)
        out.append(tok)
        if got < 0:
            return out, sib
    out.append(int(torch.multinomial(p_rows[sib, K], 1, generator=gen)))
    return out, sib


def sibling_output_law(p: torch.Tensor, q: torch.Tensor, width: int) -> torch.Tensor:
    """The exact law [V] of ``verify_siblings``'s token when ``width`` candidates are drawn i.i.d.
    from ``q``, by enumerating every candidate tuple and every accept/reject path (tiny V only)."""
    V = p.shape[0]
    law = torch.zeros(V, dtype=torch.float64)
    p, q = p.double(), q.double()
    for cands in itertools.product(range(V), repeat=width):
        w = float(torch.prod(q[list(cands)]))
        if w == 0:
            continue
        target, reach = p, 1.0  # reach: the chance every earlier sibling was rejected
        for x in cands:
            a = accept_prob(target, q, x)
            law[x] += w * reach * a
            reach *= 1.0 - a
            target = residual(target, q)
        law += w * reach * target
    return law


def reflex_update(
    c: torch.Tensor,
    w_u: torch.Tensor,
    accepted: int,
    q: torch.Tensor,
    gamma: float,
    eta: float,
    rho: float,
) -> torch.Tensor:
    """SpecRoll's Reflex correction [H] (reconstructed): ``c <- proj_{|c| <= rho}(gamma c + eta
    (W_u[x_acc] - E_q[W_u]))``, ``w_u`` [V, H] the unembedding, ``q`` [V] the head's distribution."""
    step = w_u[accepted].double() - q.double() @ w_u.double()
    c = gamma * c.double() + eta * step
    norm = float(c.norm())
    return (c * (rho / norm) if norm > rho else c).to(torch.float32)
