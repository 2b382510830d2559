"""Seeded weight perturbation on a sharded megatron learner (cases for tests/learner/dist_cases.py).

``perturb:<dense|moe>:<layout>``, on every rank: each shard perturbs its own slice, and the exported
HF tensors equal reference/perturbation.py's noise on the unsharded HF weights bit for bit; restore
gives every parameter (the distributed optimizer's fp32 master weights) its old bits back; the ES
noise-sum update from seeds and scalar rewards equals the reference update on the HF tensors; the
3PO hook exports θ + σε(id(version)) and leaves θ, and exports θ itself at σ = 0.
``es_ckpt:<dense|moe>:<layout>``: a learner moved by ES only (its optimizer never stepped) saves a
checkpoint and loads bit for bit; both then take the same optimizer step.
"""

from __future__ import annotations

import os

import torch

import reference.perturbation as rp
from megarl.convert.hf_megatron import iter_hf_tensors
from megarl.methods.gradients.es import members, update_coefficients
from megarl.methods.gradients.perturbation import WeightPerturbation
from megarl.methods.gradients.three_po import PerturbedRollouts, ThreePOKnobs, perturbation_id


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _mismatched(got: dict, want: dict) -> list[str]:
    bad = [k for k in want if k not in got or not torch.equal(_bits(got[k]), _bits(want[k].to(got[k].dtype)))]
    return bad + sorted(set(got) - set(want))


def case_perturb(args, moe: bool, layout_name: str) -> dict:
    """See the module docstring."""
    from safetensors.torch import load_file

    from tests.learner.dist_cases import LAYOUTS, learner_for, make_hf_model, max_over_world

    _, d = make_hf_model(moe, args.workdir)
    hf = load_file(os.path.join(d, "model.safetensors"))
    ln = learner_for(LAYOUTS[layout_name], d)
    params = dict(ln.model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    pert = WeightPerturbation.of_model(ln.model, ln.groups)
    out: dict = {}

    pert.perturb(11, 1e-3)  # mostly the sparse record (3PO below, σ = 0.02: mostly chunk copies)
    bad_perturbed = _mismatched(dict(iter_hf_tensors(ln.model, ln.groups)), rp.perturb_state(hf, 11, 1e-3))
    pert.restore()
    out["patched_elements"] = pert.patched_elements
    bad_restore = [n for n, p in params.items() if not torch.equal(_bits(p.detach()), _bits(before[n]))]

    mem = members([3, 5], antithetic=True)
    rewards = torch.tensor([0.5, 0.25, 0.75, 0.0], dtype=torch.float64)
    seeds, coeffs = update_coefficients(mem, rewards, 0.02, 0.1, "zscore")
    pert.add_noise_sum(seeds, coeffs)
    want_es = rp.es_update(hf, [s for s, _ in mem], [g for _, g in mem], rewards, 0.02, 0.1, "zscore")
    bad_es = _mismatched(dict(iter_hf_tensors(ln.model, ln.groups)), want_es)

    after_es = {n: p.detach().clone() for n, p in params.items()}
    hook = PerturbedRollouts(pert, ThreePOKnobs(sigma=0.02, seed=3))
    with hook.rollout_weights(7):
        bad_3po = _mismatched(
            dict(iter_hf_tensors(ln.model, ln.groups)), rp.perturb_state(want_es, perturbation_id(3, 7), 0.02)
        )
    bad_3po += [n for n, p in params.items() if not torch.equal(_bits(p.detach()), _bits(after_es[n]))]
    zero = PerturbedRollouts(pert, ThreePOKnobs(sigma=0.0, seed=3))
    with zero.rollout_weights(8):
        bad_zero = _mismatched(dict(iter_hf_tensors(ln.model, ln.groups)), want_es)

    counts = {
        "mismatched_perturbed": bad_perturbed,
        "not_restored": bad_restore,
        "mismatched_es": bad_es,
        "mismatched_3po": bad_3po,
        "mismatched_sigma0": bad_zero,
    }
    worst = max_over_world(float(sum(len(v) for v in counts.values())))
    out.update({k: v[:3] for k, v in counts.items()})
    out["local_params"] = len(pert.maps)
    out["local_elements"] = sum(m.param.numel() for m in pert.maps)
    out["ok"] = worst == 0 and max_over_world(float(out["patched_elements"] > 0)) > 0
    return out


def case_es_checkpoint(args, moe: bool, layout_name: str) -> dict:
    """ES moves the weights without an optimizer step: such a learner saves, loads bit for bit into a
    fresh learner, and both then take the same optimizer step (GRPO after ES)."""
    from megarl.learner.dist_checkpoint import load_checkpoint, save_checkpoint
    from tests.learner.dist_cases import (
        LAYOUTS,
        PolicyGradientObjective,
        dp_shard,
        learner_for,
        make_batch,
        make_hf_model,
        max_over_world,
    )

    _, d = make_hf_model(moe, args.workdir)
    ln = learner_for(LAYOUTS[layout_name], d)
    WeightPerturbation.of_model(ln.model, ln.groups).add_noise_sum([3, 5], [1e-3, -2e-3])
    saved = {k: v.clone() for k, v in iter_hf_tensors(ln.model, ln.groups)}
    ckpt = os.path.join(args.workdir, f"es-ckpt-{'moe' if moe else 'dense'}-{layout_name}")
    save_checkpoint(ln, ckpt)
    ln2 = learner_for(LAYOUTS[layout_name], d)
    load_checkpoint(ln2, ckpt)
    after_load = _mismatched(dict(iter_hf_tensors(ln2.model, ln2.groups)), saved)
    batch = make_batch(11)
    for x in (ln, ln2):
        x.train_step(dp_shard(batch, x), PolicyGradientObjective())
    a, b = dict(iter_hf_tensors(ln.model, ln.groups)), dict(iter_hf_tensors(ln2.model, ln2.groups))
    after_step = _mismatched(a, b)
    n = max_over_world(float(len(after_load) + len(after_step)))
    return {"differ_after_load": after_load[:3], "differ_after_step": after_step[:3], "ok": n == 0}


CASES = {"perturb": case_perturb, "es_ckpt": case_es_checkpoint}
