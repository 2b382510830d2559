"""Mini-batches of a variable-size batch under data parallelism: every mini-batch holds at least
one group per replica (a streaming allocator can commit fewer groups than prompts_per_step; with
fewer groups than 2 x replicas, two mini-batches left a replica with no sequence and the loss
normalisers failed on an empty share)."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.trainer.loop import mini_batch_bounds


@settings(max_examples=60, deadline=None)
@given(groups=st.integers(0, 40), mini_batches=st.integers(1, 8), dp=st.integers(1, 4))
def test_every_mini_batch_has_a_group_per_replica(groups, mini_batches, dp):
    b = mini_batch_bounds(groups, mini_batches, dp)
    if groups < dp:
        assert b == []
        return
    assert b[0] == 0 and b[-1] == groups and 1 <= len(b) - 1 <= mini_batches
    assert all(hi - lo >= dp for lo, hi in itertools.pairwise(b)), b
    if dp == 1 or groups >= dp * mini_batches:  # unchanged where the batch was large enough
        assert len(b) - 1 == min(mini_batches, groups)


def test_the_smoke_case():
    assert mini_batch_bounds(2, 2, 2) == [0, 2]  # 2 committed groups, 2 mini-batches, EP=2 x DP=2
    assert mini_batch_bounds(16, 2, 2) == [0, 8, 16]
