"""Injection hooks on plain torch modules (the same hooks the trainer puts on the megatron model):
NaN/Inf in outputs and gradients, real float16 compute with an emulated loss scale that overflows,
bfloat16 rounding, perturbed logits, poisoned batches. Fast: no process group."""

import pytest
import torch

from megarl.batch import from_sequences
from megarl.faults.config import InjectionConfig
from megarl.faults.injection import InjectionError, Injector


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        self.output_layer = torch.nn.Linear(8, 5)

    def forward(self, x):
        return self.output_layer(x + self.mlp(x))


def run(model, x):
    model.zero_grad()
    out = model(x)
    out.square().sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return out.detach(), grads


def test_nan_in_a_module_output_only_while_armed():
    m, x = Tiny(), torch.randn(4, 8)
    inj = Injector(m, [InjectionConfig(kind="nan", target="mlp", step=3)])
    clean, _ = run(m, x)
    assert inj.arm(2) == []
    inj.arm(3)
    out, grads = run(m, x)
    inj.disarm()
    assert torch.isnan(out).any() and torch.isnan(grads).any()
    again, _ = run(m, x)
    assert torch.equal(again, clean)


def test_inf_in_a_parameter_gradient():
    m, x = Tiny(), torch.randn(4, 8)
    inj = Injector(
        m, [InjectionConfig(kind="inf", target="mlp.0.weight", where="grad", step=1, fraction=0.1)]
    )
    inj.arm(1)
    out, _ = run(m, x)
    inj.disarm()
    g = m.mlp[0].weight.grad
    assert torch.isfinite(out).all()
    assert int(torch.isinf(g).sum()) == round(0.1 * g.numel())
    assert torch.isfinite(m.mlp[2].weight.grad).all()


def test_fp16_module_computes_in_half_and_a_large_loss_scale_overflows():
    m, x = Tiny(), torch.randn(4, 8)
    ref_out, ref_grads = run(m, x)
    seen = {}
    m.mlp[0].register_forward_hook(lambda mod, a, o: seen.update(dtype=o.dtype))
    inj = Injector(m, [InjectionConfig(kind="fp16", target="mlp", step=1, loss_scale=1.0)])
    inj.arm(1)
    out, grads = run(m, x)
    inj.disarm()
    assert seen["dtype"] == torch.float16  # really computed in half
    assert torch.isfinite(grads).all()
    assert 0 < (out - ref_out).abs().max() < 1e-2  # fp16 rounding, no more
    assert (grads - ref_grads).abs().max() < 1e-2
    assert all(p.dtype == torch.float32 for p in m.parameters())  # parameters restored
    inj = Injector(m, [InjectionConfig(kind="fp16", target="mlp", step=1, loss_scale=1.0e9)])
    inj.arm(1)
    _, grads = run(m, x)
    inj.disarm()
    assert not torch.isfinite(grads).all()  # the scaled gradient overflowed float16
    assert torch.isfinite(m.output_layer.weight.grad).all()  # outside the module: untouched


def test_bf16_module_rounds_like_bfloat16():
    m, x = Tiny(), torch.randn(4, 8)
    ref, _ = run(m, x)
    inj = Injector(m, [InjectionConfig(kind="bf16", target="mlp", step=1)])
    inj.arm(1)
    out, grads = run(m, x)
    inj.disarm()
    err = (out - ref).abs().max()
    assert 1e-4 < err < 1e-1 and torch.isfinite(grads).all()


def test_logits_perturbation_hits_the_output_layer():
    m, x = Tiny(), torch.randn(4, 8)
    ref, _ = run(m, x)
    inj = Injector(m, [InjectionConfig(kind="logits", step=1, scale=3.0, noise=0.5, seed=1)])
    inj.arm(1)
    out, _ = run(m, x)
    inj.disarm()
    g = torch.Generator().manual_seed(1)
    assert torch.allclose(out, ref * 3.0 + 0.5 * torch.randn(ref.shape, generator=g), atol=1e-6)


def test_poisoned_batch_advantages_and_tokens():
    b = from_sequences([[2, 3, 4], [2, 5]], [[6, 7, 8, 9], [10, 11]], [0, 0])
    b.advantages = torch.ones(b.num_tokens)
    inj = Injector(
        Tiny(),
        [
            InjectionConfig(kind="poison", field="advantages", scale=1e6, step=2),
            InjectionConfig(kind="poison", field="tokens", fraction=0.5, step=2, seed=3),
        ],
        vocab_size=100,
    )
    same, specs = inj.poison(b, 1)
    assert same is b and specs == []
    bad, specs = inj.poison(b, 2)
    assert len(specs) == 2 and torch.equal(b.advantages, torch.ones(b.num_tokens))  # original untouched
    assert bad.advantages.max() == 1e6
    changed = (bad.tokens != b.tokens).nonzero().flatten()
    assert 0 < changed.numel() <= 3 and bool((b.loss_mask[changed] > 0).all())  # response tokens only


def test_unknown_targets_are_named_before_any_step():
    with pytest.raises(InjectionError, match=r"faults.inject\[0\].target='mlp.9' is not a module"):
        Injector(Tiny(), [InjectionConfig(kind="nan", target="mlp.9")])
    with pytest.raises(InjectionError, match=r"not a parameter of the model; e.g. .*weight"):
        Injector(Tiny(), [InjectionConfig(kind="nan", target="mlp.0.weightt", where="grad")])
