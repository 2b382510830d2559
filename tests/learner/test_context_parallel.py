"""The context-parallel layout of a packed row (megarl/learner/context_parallel.py). Loss, gradient and
checkpoint equality of CP=2 runs with CP=1 run under real gloo ranks in test_learner_dist.py
(``*:cp2``, ``*:tp2cp2``, ``*:pp2cp2``, ``*:ep2cp2``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.learner.context_parallel import cp_partition, padded_positions, padded_tokens
from megarl.learner.forward import packed_inputs


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    cp=st.sampled_from([1, 2, 3, 4]),
    multiple=st.sampled_from([1, 2]),
)
def test_every_token_on_exactly_one_rank_with_equal_causal_work(lens, cp, multiple):
    cu = _cu(lens)
    parts = [cp_partition(cu, cp, r, multiple) for r in range(cp)]
    T_pad = int(parts[0].cu_padded[-1])
    pad_lens = (parts[0].cu_padded[1:] - parts[0].cu_padded[:-1]).tolist()
    assert all(p % (2 * cp * multiple) == 0 and p >= n for p, n in zip(pad_lens, lens))
    everything = torch.cat([p.index for p in parts])
    assert torch.equal(everything.sort().values, torch.arange(T_pad))
    assert int(parts[0].real.sum()) == sum(lens)
    pos = padded_positions(parts[0])
    # causal work of a token = its position + 1; the two mirrored chunks make it equal on every rank
    work = [int((pos[p.index] + 1).sum()) for p in parts]
    assert len(set(work)) == 1
    for p in parts:  # each rank holds L_pad / cp tokens of every sequence
        assert torch.equal(p.local_cu_seqlens, p.cu_padded // cp)
        assert p.index.numel() == T_pad // cp


def test_chunks_follow_the_load_balanced_layout():
    # one sequence of 8 tokens at cp=2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    p0, p1 = (cp_partition(_cu([8]), 2, r) for r in range(2))
    assert p0.index.tolist() == [0, 1, 6, 7]
    assert p1.index.tolist() == [2, 3, 4, 5]
    # a 5-token sequence is padded to 8; padding is token 0 and not real
    p = cp_partition(_cu([5, 3]), 2, 0)
    assert p.cu_padded.tolist() == [0, 8, 12]
    toks = padded_tokens(torch.tensor([5, 6, 7, 8, 9, 1, 2, 3]), p)
    assert toks.tolist() == [5, 6, 7, 8, 9, 0, 0, 0, 1, 2, 3, 0]
    assert p.real.tolist() == [True] * 5 + [False] * 3 + [True] * 3 + [False]


def test_a_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        cp_partition(_cu([4]), 2, 2)


def test_a_group_of_one_rank_is_no_context_parallelism(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this worker")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        # a CP group of one rank is no context parallelism: the plain inputs come back
        inp = packed_inputs(
            torch.arange(6), _cu([2, 4]), torch.device("cpu"), attention="dense", cp_group=group
        )
        assert inp.cp_partition is None and inp.num_tokens == 6
    finally:
        dist.destroy_process_group()
