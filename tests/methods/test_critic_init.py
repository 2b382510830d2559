"""The critic's trunk starts from the policy, at random, or from another HF checkpoint (``init``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.methods.critics.critic import CriticKnobs

ROOT = Path(__file__).parents[2]

_CASE = r"""
import json, sys, types, torch
from megarl.learner.parallel import ParallelLayout, init_distributed, initialize_parallel
from megarl.learner.optim_config import OptimConfig
from megarl.methods.critics.critic import Critic, CriticKnobs
from megarl.convert.hf_megatron import HFSafetensorsReader
policy, other = sys.argv[1], sys.argv[2]
init_distributed()
hf = json.load(open(policy + "/config.json"))
NS = types.SimpleNamespace
cfg = NS(optimizer=OptimConfig(lr=1e-3), model=NS(params_dtype="float32", seed=1),
         schedule=NS(micro_batches=1))
ctx = NS(cfg=cfg, hf_config=hf, groups=initialize_parallel(ParallelLayout()), init_dir=policy)
out = {}
for init in ("policy", other, "random"):
    emb = Critic(ctx, CriticKnobs(init=init)).learner.model.embedding.word_embeddings.weight.detach()
    out[init if init in ("policy", "random") else "other"] = {
        src: bool(torch.equal(emb, HFSafetensorsReader(d).get("model.embed_tokens.weight")))
        for src, d in (("policy", policy), ("other", other))
    }
print(json.dumps(out))
"""


def test_init_names_the_trunk_source(tmp_path):
    from tests.learner.convert_helpers import make_tiny_hf

    policy = make_tiny_hf(tmp_path / "policy", moe=False, seed=0)
    other = make_tiny_hf(tmp_path / "other", moe=False, seed=5)
    env = dict(os.environ, PYTHONPATH=str(ROOT), MEGARL_FORCE_CPU="1", MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(29000 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    p = subprocess.run(
        [sys.executable, "-c", _CASE, str(policy), str(other)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res == {
        "policy": {"policy": True, "other": False},
        "other": {"policy": False, "other": True},
        "random": {"policy": False, "other": False},
    }


def test_init_refuses_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="not policy, random or an HF checkpoint directory"):
        CriticKnobs(init=str(tmp_path)).check()
