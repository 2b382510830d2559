"""Step structure of multi-turn batches, shared by the step-level estimators (GiGPO, PGPO).

Step k of sequence i is its k-th ``turn_spans`` entry with role ``assistant``. The batch carries
``extras["step_state_keys"]`` [B, S] long: a non-negative key of the environment state the step
acted in (-1 = no step), and optionally ``extras["step_rewards"]`` [B, S] float (per-step rewards;
without it the outcome reward ``rewards[i]`` sits on the last step).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from megarl.batch import PackedBatch


def state_key(token_ids) -> int:
    """A stable non-negative 63-bit key of a state given as token ids (same ids -> same key)."""
    data = ",".join(str(int(t)) for t in token_ids).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def anchor_state_keys(batch: PackedBatch, role: str = "assistant") -> torch.Tensor:
    """[B, S] keys of the span right before each ``role`` span (the observation the step saw), -1 padded."""
    if batch.turn_spans is None:
        raise ValueError("anchor_state_keys needs the batch field 'turn_spans'")
    rows = []
    for i, spans in enumerate(batch.turn_spans):
        start = int(batch.cu_seqlens[i])
        keys, prev = [], None
        for s, e, r in spans:
            if r == role:
                keys.append(
                    state_key(batch.tokens[start + prev[0] : start + prev[1]].tolist()) if prev else 0
                )
            prev = (s, e)
        rows.append(keys)
    S = max([len(r) for r in rows] + [1])
    out = torch.full((len(rows), S), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


@dataclass
class Steps:
    """Flat list of the N steps of a batch (sequence-major, step order)."""

    seq: torch.Tensor  # [N] sequence of each step
    index: torch.Tensor  # [N] step index inside its sequence
    key: torch.Tensor  # [N] state key
    reward: torch.Tensor  # [N] step reward
    spans: list  # per sequence: [(start, end)] token positions of its steps, in order
    counts: torch.Tensor  # [B] steps per sequence


def batch_steps(batch: PackedBatch, role: str = "assistant") -> Steps:
    """Read the steps of ``batch`` (see the module docstring), checking that spans and keys agree."""
    if batch.turn_spans is None:
        raise ValueError("step-level advantages need the batch field 'turn_spans'")
    if "step_state_keys" not in batch.extras:
        raise ValueError("step-level advantages need batch.extras['step_state_keys'] (see anchor_state_keys)")
    keys = batch.extras["step_state_keys"].long()
    spans = [[(s, e) for s, e, r in sp if r == role] for sp in batch.turn_spans]
    counts = (keys >= 0).sum(1)
    for i, sp in enumerate(spans):
        if len(sp) != int(counts[i]) or bool((keys[i, : len(sp)] < 0).any()):
            raise ValueError(
                f"extras.step_state_keys, sequence {i}: {int(counts[i])} keys for {len(sp)} "
                f"'{role}' spans (keys must be >= 0 and fill the first positions)"
            )
    valid = keys >= 0
    seq, index = valid.nonzero(as_tuple=True)
    rewards = torch.as_tensor(batch.rewards).double()
    if rewards.dim() != 1:
        raise ValueError("step-level advantages need scalar 'rewards' [B]")
    if "step_rewards" in batch.extras:
        step_r = batch.extras["step_rewards"].double()[seq, index]
    else:
        last = index == (counts[seq] - 1)
        step_r = torch.where(last, rewards[seq], torch.zeros_like(rewards[seq]))
    return Steps(seq=seq, index=index, key=keys[seq, index], reward=step_r, spans=spans, counts=counts)


def discounted_returns(steps: Steps, num_seqs: int, gamma: float) -> torch.Tensor:
    """G_{i,t} = r_{i,t} + γ G_{i,t+1} per step; [N]."""
    S = int(steps.counts.max()) if steps.counts.numel() else 0
    r = torch.zeros(num_seqs, S + 1, dtype=torch.float64)
    r[steps.seq, steps.index] = steps.reward
    g = torch.zeros_like(r)
    for t in range(S - 1, -1, -1):
        g[:, t] = r[:, t] + gamma * g[:, t + 1]
    return g[steps.seq, steps.index]


def anchor_groups(group_ids: torch.Tensor, steps: Steps) -> torch.Tensor:
    """[N] id of each step's anchor-state group: same rollout group and same state key."""
    pairs = torch.stack([group_ids[steps.seq].long(), steps.key], 1)
    return torch.unique(pairs, dim=0, return_inverse=True)[1]


def steps_to_tokens(
    step_adv: torch.Tensor, episode_adv: torch.Tensor, steps: Steps, batch: PackedBatch
) -> torch.Tensor:
    """[T]: each step's advantage on the tokens of its span, the episode advantage on other loss tokens."""
    from megarl.ops.segments import broadcast_to_tokens

    out = broadcast_to_tokens(episode_adv, batch.cu_seqlens).clone()
    n = 0
    for i, sp in enumerate(steps.spans):
        start = int(batch.cu_seqlens[i])
        for s, e in sp:
            out[start + s : start + e] = step_adv[n]
            n += 1
    return out * batch.loss_mask.double()
