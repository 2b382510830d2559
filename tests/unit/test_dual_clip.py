"""PPO's dual clip at hand-computed points: ℓ = max(−rA, −clip(r, 1−ε_l, 1+ε_h)·A), then for A < 0
only ℓ = min(ℓ, −c·A) (c = 3). Each point pins one part: the cap's sign and size, that it is a
cap (min), and that positive advantages are left alone."""

import math

import pytest
import torch

from megarl.objectives.policy_losses import POLICY_LOSSES

# (log-ratio, advantage) -> (loss, d loss / d logp)
POINTS = [
    (2.0, -1.0, 3.0, 0.0),  # r = e² > c: capped at −c·A = 3, no gradient
    (math.log(2.0), -1.0, 2.0, 2.0),  # 1+ε_h < r < c: −r·A = 2 is below the cap, gradient r·|A|
    (math.log(2.0), -0.5, 1.0, 1.0),
    (math.log(0.5), -1.0, 0.8, 0.0),  # r < 1−ε_l: the clipped term (1−ε_l)·|A| = 0.8
    (math.log(5.0), 1.0, -1.28, 0.0),  # A > 0: no dual clip, the clip at 1+ε_h
    (math.log(1.1), 2.0, -2.2, -2.2),  # A > 0 inside the clip range: −r·A
]


@pytest.mark.parametrize("delta, adv, want_loss, want_grad", POINTS)
def test_ppo_dual_clip_values_and_gradients(delta, adv, want_loss, want_grad):
    old = torch.tensor([-1.5], dtype=torch.float64)
    logp = (old + delta).requires_grad_(True)
    a = torch.tensor([adv], dtype=torch.float64)
    loss = POLICY_LOSSES.get("ppo")(logp, old, a, torch.ones(1), torch.tensor([0, 1]), 0.2, 0.28, 3.0)
    loss.sum().backward()
    assert float(loss.detach()) == pytest.approx(want_loss, abs=1e-12)
    assert float(logp.grad) == pytest.approx(want_grad, abs=1e-12)
