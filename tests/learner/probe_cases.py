"""The policy probes on a sharded megatron learner (cases for tests/learner/dist_cases.py).

``probe:<dense|moe>:<layout>``, on every rank: the attention concentration recomputed from the
learner's queries and keys (megarl.methods.critics.comp_gae ``ConcentrationPass``; heads split over
TP, layers over PP) equals reference/critics.py ``attention_concentration`` of transformers' eager
attention probabilities, each sequence on its own, averaged over every head and layer; the trunk's
final hidden states (megarl.methods.critics.probe ``hidden_states``; gathered under sequence
parallelism, shared across PP stages) equal transformers' last hidden states; for an MoE policy the
router features (``router_features``) equal the top-k normalised softmax of transformers' router
logits of every MoE layer.
"""

from __future__ import annotations

import itertools

import torch

import reference.critics as rc
from megarl.methods.critics.comp_gae import CONCENTRATION, ConcentrationKnobs, ConcentrationPass
from megarl.methods.critics.probe import hidden_states, router_features


def _routing_weights(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k of the softmax, renormalised over the k (Qwen3-MoE's norm_topk_prob), 0 elsewhere."""
    p = torch.softmax(logits, -1)
    top, idx = p.topk(k, -1)
    return torch.zeros_like(p).scatter(-1, idx, top / top.sum(-1, keepdim=True))


def case_probe(args, moe: bool, layout_name: str) -> dict:
    """See the module docstring."""
    from tests.learner.dist_cases import (
        LAYOUTS,
        PARITY_TOL,
        learner_for,
        make_batch,
        make_hf_model,
        max_over_world,
    )

    hf, d = make_hf_model(moe, args.workdir)
    hf.config._attn_implementation = "eager"
    ln = learner_for(LAYOUTS[layout_name], d)
    batch = make_batch(13)
    ConcentrationPass(ln, ConcentrationKnobs()).fill(batch, 2)
    got = batch.token_extras[CONCENTRATION]
    hidden = hidden_states(ln, batch, 2, -1)
    want = torch.zeros_like(got)
    want_hidden = []
    cu = batch.cu_seqlens.tolist()
    for a, b in itertools.pairwise(cu):
        with torch.no_grad():
            out = hf(batch.tokens[None, a:b], output_attentions=True, output_hidden_states=True)
        kappa = torch.stack([rc.attention_concentration(p[0]) for p in out.attentions]).mean(0)
        want[a + 1 : b] = kappa[:-1]
        want_hidden.append(out.hidden_states[-1][0])
    d_router = 0.0
    if moe:  # TAC's router features: the top-k normalised routing weights of every MoE layer
        feats = router_features(ln, batch, 2)
        ref = []
        for a, b in itertools.pairwise(cu):
            with torch.no_grad():
                logits = hf(batch.tokens[None, a:b], output_router_logits=True).router_logits
            ref.append(torch.cat([_routing_weights(lg.reshape(b - a, -1).float(), 2) for lg in logits], 1))
        d_router = max_over_world(float((feats - torch.cat(ref)).abs().max()))
    d_kappa = max_over_world(float((got - want).abs().max()))
    d_hidden = max_over_world(float((hidden - torch.cat(want_hidden)).abs().max()))
    spread = float(want[1:].std())
    return {
        "kappa_vs_hf": d_kappa,
        "hidden_vs_hf": d_hidden,
        "router_vs_hf": d_router,
        "kappa_std": spread,
        "ok": d_kappa <= PARITY_TOL and d_hidden <= PARITY_TOL and d_router <= PARITY_TOL and spread > 1e-3,
    }


CASES = {"probe": case_probe}
