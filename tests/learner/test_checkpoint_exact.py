"""Checkpoint save -> load restores every parameter bit for bit (real megatron-core + gloo, 2 ranks).

Tied and untied embeddings, PP 1 (DP 2) and PP 2 (loaded at PP 2 and at TP 1), a vocabulary whose
embedding size is not a multiple of 128 (1002 x 48) and one that is (1024 x 48): the distributed
optimizer pads its buckets to 128 elements, and with PP > 1 a tied embedding gets a bucket of its own.
MoE checkpoints load across EP sizes (EP 2 <-> EP 1, TP 2 + SP -> EP 2), and the EP changes that are
not supported are refused up front. The cases live in dist_cases.py (``case_checkpoint_exact``,
``case_checkpoint_refused``).
"""

from __future__ import annotations

import pytest
from test_learner_dist import _check, _launch

CASES = [
    f"ckexact:{v}:{lay}"
    for v in ("tied1002", "untied1002", "tied1024", "untied1024")
    for lay in ("tp1", "pp2:tp1")
] + [
    # MoE across EP sizes: the dense and expert optimizers of EP > 1 vs the single one of EP = 1
    "ckexact:moe:ep2:tp1",
    "ckexact:moe:tp1:ep2",
    "ckexact:moe:tp2sp:ep2",
    # EP changes that stay refused, before any tensor is read
    "ckrefuse:moe:ep2:tp1",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _launch(2, CASES, str(tmp_path_factory.mktemp("ckexact")), timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_save_load_is_bit_exact(results, case):
    _check(results, case)
