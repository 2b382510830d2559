"""A weight export killed before its rename leaves ``<dir>.tmp-megarl``; the next export of the
same directory (the same weights version after a resume) replaces it instead of failing."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

from megarl.convert import hf_megatron


@pytest.fixture
def one_rank(monkeypatch):
    """``save_hf_checkpoint`` on one rank with two known tensors (no process group, no model)."""
    tensors = {"model.embed_tokens.weight": torch.arange(6.0).view(2, 3), "lm_head.weight": torch.ones(2, 3)}
    monkeypatch.setattr(hf_megatron, "dist", SimpleNamespace(get_rank=lambda: 0, barrier=lambda: None))
    monkeypatch.setattr(hf_megatron, "iter_hf_buckets", lambda model, groups, bucket_bytes: iter([tensors]))
    return tensors


def _check_export(out, tensors):
    from safetensors.torch import load_file

    assert sorted(os.listdir(out)) == [
        "config.json",
        "model-00000.safetensors",
        "model.safetensors.index.json",
    ]
    got = load_file(str(out / "model-00000.safetensors"))
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())
    assert json.loads((out / "config.json").read_text()) == {"model_type": "qwen3"}
    assert not os.path.lexists(str(out) + ".tmp-megarl")


@pytest.mark.parametrize("stale", ["dir", "file"])
def test_stale_temporary_of_a_killed_export_is_replaced(tmp_path, one_rank, stale):
    out = tmp_path / "weights" / "v000003"
    tmp = tmp_path / "weights" / "v000003.tmp-megarl"
    if stale == "dir":  # killed half-way: a truncated shard and no index
        tmp.mkdir(parents=True)
        (tmp / "model-00000.safetensors").write_bytes(b"\0" * 10)
        (tmp / "model-00001.safetensors").write_bytes(b"\0" * 10)
    else:
        tmp.parent.mkdir(parents=True)
        tmp.write_bytes(b"partial")
    wm = hf_megatron.save_hf_checkpoint(None, None, out, hf_config={"model_type": "qwen3"})
    assert wm == {k: "model-00000.safetensors" for k in one_rank}
    _check_export(out, one_rank)


def test_existing_export_is_still_not_overwritten(tmp_path, one_rank):
    out = tmp_path / "v000001"
    out.mkdir()
    with pytest.raises(FileExistsError, match="v000001 exists; refusing to overwrite"):
        hf_megatron.save_hf_checkpoint(None, None, out)
