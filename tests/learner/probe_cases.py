"""The policy probes on a sharded megatron learner (cases for tests/learner/dist_cases.py).

``probe:<dense|moe>:<layout>``, on every rank: the attention concentration recomputed from the
learner's queries and keys (megarl.methods.critics.comp_gae ``ConcentrationPass``; heads split over
TP, layers over PP) equals reference/critics.py ``attention_concentration`` of transformers' eager
attention probabilities, each sequence on its own, averaged over every head and layer; the trunk's
final hidden states (megarl.methods.critics.probe ``hidden_states``; gathered under sequence
parallelism, shared across PP stages) equal transformers' last hidden states.
"""

from __future__ import annotations

import itertools

import torch

import reference.critics as rc
from megarl.methods.critics.comp_gae import CONCENTRATION, ConcentrationKnobs, ConcentrationPass
from megarl.methods.critics.probe import hidden_states


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
    d_kappa = max_over_world(float((got - want).abs().max()))
    d_hidden = max_over_world(float((hidden - torch.cat(want_hidden)).abs().max()))
    spread = float(want[1:].std())
    return {
        "kappa_vs_hf": d_kappa,
        "hidden_vs_hf": d_hidden,
        "kappa_std": spread,
        "ok": d_kappa <= PARITY_TOL and d_hidden <= PARITY_TOL and spread > 1e-3,
    }


CASES = {"probe": case_probe}
