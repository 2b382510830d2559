"""``PartInfo.group_relative`` is true exactly for the estimators whose advantages are all 0 when
every prompt has one sample (the config refuses rollout.n=1 with them)."""

import pytest
import torch

from megarl.advantages import ADVANTAGE_ESTIMATORS
from megarl.batch import PackedBatch
from megarl.catalogue import load_builtin

load_builtin()
# estimators whose inputs the probe batch carries: rewards only, entropies (gepo), RRPO's scores,
# named reward dimensions (rspo); the step- and checkpoint-based ones have their own tests
# (``stored`` reads the replayed advantages of a batch source: tests/methods/test_regen_replay.py;
# these read per-sample extras a rollout workflow or allocator writes, and their own tests cover
# groups: pair_ht (tests/methods/test_pair.py, pi = 1 equals rloo), reflectrl (test_reflectrl.py),
# srrl (test_srrl.py))
OWN_TESTS = {"stored", "pair_ht", "reflectrl", "srrl"}
PLAIN = [
    n
    for n in ADVANTAGE_ESTIMATORS.names()
    if not ADVANTAGE_ESTIMATORS.info(n).batch_inputs and n not in OWN_TESTS
]
PROBED = PLAIN + ["gepo", "rrpo", "rspo"]


def batch(group_ids: list[int], rewards: list[float], dims: bool = False) -> PackedBatch:
    """Sequences of 2 prompt + 3 response tokens; ``rrpo_scores`` = the rewards; ``dims``: rewards
    [B, 2] named outcome and process."""
    B = len(group_ids)
    mask = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0] * B)
    r = torch.tensor(rewards, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    return PackedBatch(
        tokens=torch.zeros(5 * B, dtype=torch.long),
        cu_seqlens=torch.arange(B + 1) * 5,
        prompt_lens=torch.full((B,), 2),
        loss_mask=mask,
        group_ids=torch.tensor(group_ids),
        rewards=torch.stack([r, torch.rand(B, generator=g)], 1) if dims else r,
        reward_names=["outcome", "process"] if dims else None,
        values=torch.zeros(5 * B),
        entropies=torch.rand(5 * B, generator=g),
        extras={"rrpo_scores": r},
    )


@pytest.mark.parametrize("name", PROBED)
def test_group_relative_flag_matches_zero_advantages_for_groups_of_one(name):
    fn = ADVANTAGE_ESTIMATORS.get(name)
    dims = name == "rspo"
    pairs = fn(batch([0, 0, 1, 1], [1.0, 0.0, 0.5, 1.0], dims))
    assert bool(pairs.abs().sum() > 0), name  # the probe batch does move this estimator
    try:
        ones = fn(batch([0, 1, 2, 3], [1.0, 0.0, 0.5, 1.0], dims))
        all_zero = bool((ones == 0).all())
    except ValueError:  # the estimator refuses groups of one itself (grpo_passk): as good as all zero
        all_zero = True
    assert ADVANTAGE_ESTIMATORS.info(name).group_relative == all_zero, name


def test_the_core_group_estimators_are_flagged():
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "softmax_grpo", "rrpo", "gepo", "rspo"):
        assert ADVANTAGE_ESTIMATORS.info(name).group_relative, name
