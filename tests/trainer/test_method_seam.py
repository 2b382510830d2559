"""The seam between the trainer and the methods: the trainer names no method, registration runs one
way, a method is resolved by name or imported from the user's package, a knob left unset means the
part's own default, and the plugin example's step hook behaves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.batch import from_sequences
from megarl.objectives.rl_objective import build_objective
from megarl.trainer.config import ConfigError, from_dict

ROOT = Path(__file__).parents[2]
PLUGINS = ROOT / "examples" / "plugins"
METHOD_NAMES = (
    "gapo",
    "eppo",
    "estr",
    "sao",
    "cokl",
    "output_reset",
    "softmax_grpo",
    "gepo",
    "taco",
    "dash",
    "pgpo",
    "gigpo",
    "rspo",
    "amrp",
    "rrpo",
    "cedar",
    "care",
    "rubric",
    "reward_floor",
    "gpg",
    "gmpo",
    "clip_cov",
    "kl_cov",
    "bypass",
    "bypass_reinforce",
    "opo",
    "grpo_passk",
    "remax",
    "kl_reward",
    "k1_k2grad",
    "otb",
    "sum_pi_squared",
    "dro",
    "srpo",
    "crpo",
    "reflectrl",
)
BASE = {
    "model": {"hf_config": {"model_type": "qwen3", "vocab_size": 32}, "alphabet": "0123456789R= "},
    "data": {"train": "unused.jsonl"},
}


# concepts of particular methods and workflows: their owners contribute them (megarl/plugin/config_parts.py)
METHOD_WORDS = ("teacher", "reflect", "review", "trajector")


def test_the_trainer_names_no_method():
    names = r"\b(" + "|".join(METHOD_NAMES) + r")\b"
    pattern = re.compile(names + "|" + "|".join(METHOD_WORDS), re.IGNORECASE)
    hits = []
    for f in sorted((ROOT / "megarl" / "trainer").rglob("*.py")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_objectives_and_advantages_do_not_import_the_method_families():
    code = (
        "import sys, megarl.objectives.rl_objective, megarl.advantages, megarl.registry; "
        "print(sorted(m for m in sys.modules if m.startswith(('megarl.methods', 'megarl.rewards', "
        "'megarl.trainer'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_gspo_without_clip_keys_uses_its_own_range():
    own = build_objective({"policy_loss": "gspo"})
    assert own.clip == {"clip_low": 3e-4, "clip_high": 4e-4, "dual_clip": None}
    assert build_objective({"policy_loss": "ppo"}).clip == {
        "clip_low": 0.2,
        "clip_high": 0.28,
        "dual_clip": None,
    }
    assert build_objective({"policy_loss": "gspo", "clip_high": 0.01}).clip["clip_high"] == 0.01
    assert from_dict(dict(BASE, objective={"policy_loss": "gspo"})).objective.clip_low is None
    # the loss itself: with a sequence ratio of exp(0.01) GSPO's own range clips, PPO's would not
    b = from_sequences([[1, 2]], [[3, 4, 5]], [0], rewards=torch.tensor([1.0]))
    b.advantages = b.loss_mask.float()
    b.old_logprobs = torch.full((b.num_tokens,), -2.0)
    logits = torch.zeros(b.num_tokens, 8, requires_grad=True)
    from megarl.objectives.api import GlobalNormalisers, LossContext

    ctx = LossContext(GlobalNormalisers.from_batch(b))
    clipped = build_objective({"policy_loss": "gspo"})(logits, b, ctx).metrics["clip_frac"]
    wide = build_objective({"policy_loss": "gspo", "clip_low": 0.2, "clip_high": 0.28})(logits, b, ctx)
    assert float(clipped) > 0 and float(wide.metrics["clip_frac"]) == 0


def test_a_method_by_name_sets_its_parts_and_user_keys_win():
    cfg = from_dict(dict(BASE, method={"name": "gepo"}))
    assert cfg.advantage.estimator == "gepo"
    cfg = from_dict(dict(BASE, method={"name": "gepo"}, advantage={"estimator": "rloo"}))
    assert cfg.advantage.estimator == "rloo"
    assert from_dict(dict(BASE, method={"name": "cokl"})).objective.regularisers[0]["name"] == "cokl"


@pytest.fixture
def plugin_path(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))


def test_a_method_imported_from_the_users_package(plugin_path):
    cfg = from_dict(dict(BASE, method={"import": "bounded_advantages:SPEC", "bound": 1.5}))
    assert cfg.advantage.estimator == "grpo" and cfg.method["bound"] == 1.5
    with pytest.raises(ConfigError, match=r"method: bound=-1.0 must be > 0"):
        from_dict(dict(BASE, method={"import": "bounded_advantages:SPEC", "bound": -1.0}))
    with pytest.raises(ConfigError, match=r"unknown key method.bownd; allowed: bound"):
        from_dict(dict(BASE, method={"import": "bounded_advantages:SPEC", "bownd": 1.0}))
    with pytest.raises(ConfigError, match=r"has no attribute 'SPECS'"):
        from_dict(dict(BASE, method={"import": "bounded_advantages:SPECS"}))


def test_the_plugin_hook_clips_and_keeps_its_count(plugin_path):
    from bounded_advantages import BoundAdvantages, bounded

    b = from_sequences([[1], [1]], [[2, 3], [4]], [0, 0], rewards=torch.tensor([1.0, 0.0]))
    b.advantages = torch.tensor([0.0, 3.0, -0.5, 0.0, -2.0])
    hook = BoundAdvantages(1.0)
    out = hook.before_train(1, b)
    assert torch.equal(out.advantages, bounded(torch.tensor([0.0, 3.0, -0.5, 0.0, -2.0]), 1.0))
    assert hook.after_step(1, {}) == {"bounded/clipped_frac": 2 / 3, "bounded/clipped_total": 2.0}
    fresh = BoundAdvantages(1.0)
    fresh.load_state_dict(hook.state_dict())
    assert fresh.clipped_total == 2
