"""Hypothesis strategy for multi-turn batches: prompt, then (assistant, observation) turns, with
anchor-state keys drawn from a small set so states recur across a group's trajectories."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from megarl.batch import PackedBatch


@st.composite
def agent_batches(
    draw,
    max_groups: int = 3,
    max_group_size: int = 4,
    max_steps: int = 3,
    n_states: int = 3,
    with_step_rewards=None,
):
    sizes = draw(st.lists(st.integers(1, max_group_size), min_size=1, max_size=max_groups))
    gids = [g for g, n in enumerate(sizes) for _ in range(n)]
    step_rewards_given = draw(st.booleans()) if with_step_rewards is None else with_step_rewards
    toks, mask, lens, spans, keys, srew, plens = [], [], [], [], [], [], []
    for _ in gids:
        n = draw(st.integers(1, max_steps))
        p = draw(st.integers(1, 2))
        seq_t, seq_m, sp = [1] * p, [0.0] * p, [(0, p, "prompt")]
        for _k in range(n):
            a = draw(st.integers(1, 2))
            s = len(seq_t)
            seq_t += [2] * a
            seq_m += [0.0 if draw(st.integers(0, 4)) == 0 else 1.0 for _ in range(a)]
            sp.append((s, s + a, "assistant"))
            s = len(seq_t)
            seq_t += [3]
            seq_m += [0.0]
            sp.append((s, s + 1, "observation"))
        toks += seq_t
        mask += seq_m
        lens.append(len(seq_t))
        spans.append(sp)
        plens.append(p)
        keys.append(draw(st.lists(st.integers(0, n_states - 1), min_size=n, max_size=n)))
        srew.append(draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n, max_size=n)))
    B = len(gids)
    S = max(len(k) for k in keys)
    key_t = torch.full((B, S), -1, dtype=torch.long)
    rew_t = torch.zeros(B, S, dtype=torch.float64)
    for i in range(B):
        key_t[i, : len(keys[i])] = torch.tensor(keys[i])
        rew_t[i, : len(srew[i])] = torch.tensor(srew[i], dtype=torch.float64)
    cu = torch.zeros(B + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    outcome = [float(draw(st.sampled_from([0.0, 1.0]))) for _ in gids]
    if step_rewards_given:
        rewards = rew_t.sum(1)
        extras = {"step_state_keys": key_t, "step_rewards": rew_t}
    else:
        rewards = torch.tensor(outcome, dtype=torch.float64)
        srew = [[0.0] * (len(k) - 1) + [outcome[i]] for i, k in enumerate(keys)]
        extras = {"step_state_keys": key_t}
    b = PackedBatch(
        tokens=torch.tensor(toks),
        cu_seqlens=cu,
        prompt_lens=torch.tensor(plens),
        loss_mask=torch.tensor(mask, dtype=torch.float64),
        group_ids=torch.tensor(gids),
        rewards=rewards,
        turn_spans=spans,
        extras=extras,
    ).validate()
    step_spans = [[(s, e) for s, e, r in sp if r == "assistant"] for sp in spans]
    return b, keys, srew, step_spans
