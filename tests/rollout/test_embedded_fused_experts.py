"""The embedded engine loads per-expert MoE tensors (megarl's export / HF checkpoint names) into a
transformers model that stores its experts fused (``experts.gate_up_proj`` / ``experts.down_proj``):
before this was handled, the weight sync skipped the experts silently and the engine generated with
random experts (found by the trainer's MoE smoke test as a train/rollout logprob gap of ~0.05)."""

import asyncio

import pytest
import torch

from megarl.rollout.embedded import EmbeddedEngine, fuse_expert_tensors


def tiny_moe(seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    for p in model.parameters():  # fused expert parameters start uninitialised in some versions
        torch.nn.init.normal_(p, std=0.05)
    return model


def per_expert_state(model) -> dict[str, torch.Tensor]:
    """The model's tensors with fused experts split into per-expert HF checkpoint names."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("experts.gate_up_proj"):
            p, inter = k[: -len(".gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{p}.{e}.gate_proj.weight"], out[f"{p}.{e}.up_proj.weight"] = (
                    v[e, :inter].clone(),
                    v[e, inter:].clone(),
                )
        elif k.endswith("experts.down_proj"):
            p = k[: -len(".down_proj")]
            for e in range(v.shape[0]):
                out[f"{p}.{e}.down_proj.weight"] = v[e].clone()
        else:
            out[k] = v.clone()
    return out


def test_per_expert_tensors_reach_a_fused_model():
    src, dst = tiny_moe(0), tiny_moe(1)
    if not any(k.endswith("experts.gate_up_proj") for k in dst.state_dict()):
        pytest.skip("this transformers version stores Qwen3-MoE experts per expert (nothing to fuse)")
    state = per_expert_state(src)
    eng = EmbeddedEngine(dst, eos_token_ids=[0])
    asyncio.run(eng.update_weights_from_tensors(state, "v1"))
    ids = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(src(input_ids=ids).logits, dst(input_ids=ids).logits, atol=1e-6)
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k


def test_incomplete_experts_are_an_error_naming_the_tensor():
    model = tiny_moe(0)
    state = per_expert_state(model)
    name = next(k for k in state if k.endswith("experts.1.up_proj.weight"))
    del state[name]
    if not any(k.endswith("experts.gate_up_proj") for k in model.state_dict()):
        pytest.skip("per-expert model")
    with pytest.raises(ValueError, match="up_proj"):
        fuse_expert_tensors(state, set(model.state_dict()))
