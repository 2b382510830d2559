"""MASS: the greedy coverage, budget split and TopK codes equal reference/allocation.py's, and the
spec's invariants hold: the selection has exactly B rows, marginal gains never increase along the
greedy path, M = 1 is global coverage selection, the TopK SAE has exactly K non-zeros per sample,
and a fixed seed gives the same selection; plus the CLI and the prompt chooser."""

import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.methods.allocation.mass import (
    MASSChooser,
    MASSKnobs,
    greedy_coverage,
    mass_select,
    ngram_embeddings,
    sae_codes,
    split_budget,
    topk,
)
from megarl.methods.allocation.mass_cli import main
from megarl.plugin.knobs import build_knobs
from reference import allocation as ref

FAST = settings(max_examples=8, deadline=None)


@st.composite
def coverage_case(draw):
    N, F = draw(st.integers(2, 9)), draw(st.integers(2, 8))
    codes = [[draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, -2.0])) for _ in range(F)] for _ in range(N)]
    q = [draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])) for _ in range(N)]
    return q, codes, draw(st.integers(1, N)), draw(st.sampled_from(["idf", "activation"]))


@FAST
@given(case=coverage_case())
def test_greedy_coverage_equals_reference_and_gains_never_increase(case):
    q, codes, B, weight = case
    picks, gains = greedy_coverage(torch.tensor(q), torch.tensor(codes, dtype=torch.float64), B, weight)
    rp, rg = ref.mass_greedy(q, codes, B, weight)
    assert picks == rp and gains == pytest.approx(rg, rel=1e-9, abs=1e-12)
    assert len(picks) == len(set(picks)) == B
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(gains))


@FAST
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    frac=st.floats(0, 1),
    mode=st.sampled_from(["size", "sqrt"]),
)
def test_budget_split_equals_reference_and_sums_to_b(sizes, frac, mode):
    B = int(frac * sum(sizes))
    got = split_budget(sizes, B, mode)
    assert got == ref.mass_split_budget(sizes, B, mode)
    assert sum(got) == B and all(0 <= b <= s for b, s in zip(got, sizes))


@FAST
@given(seed=st.integers(0, 1000), K=st.integers(1, 6))
def test_topk_codes_have_exactly_k_non_zeros_and_equal_reference(seed, K):
    pre = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    h = topk(pre, K)
    assert ((h != 0).sum(1) == K).all()
    assert h.tolist() == ref.mass_topk(pre.tolist(), K)


def data(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(3, 12, generator=g, dtype=torch.float64) * 3
    E = centres[torch.arange(n) % 3] + 0.3 * torch.randn(n, 12, generator=g, dtype=torch.float64)
    q = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
    return E, q


KW = dict(dim=4, features=16, k=3, steps=30, lr=5e-2)


def test_selection_has_b_rows_is_seeded_and_covers_every_group():
    E, q = data()
    a = mass_select(E, q, 17, groups=3, seed=4, **KW)
    b = mass_select(E, q, 17, groups=3, seed=4, **KW)
    assert len(a.selected) == len(set(a.selected)) == 17 and a.selected == b.selected
    assert sum(a.budgets) == 17 and len(set(a.labels)) == 3
    assert [len(p) for p in a.picks] == a.budgets
    assert sorted({a.labels[i] for i in a.selected}) == [0, 1, 2]  # every coarse group is represented
    for g in a.gains:
        assert all(x >= y - 1e-12 for x, y in itertools.pairwise(g))


def test_one_group_is_global_coverage_selection():
    E, q = data(40, 1)
    sel = mass_select(E, q, 9, groups=1, seed=2, **KW)
    gen = torch.Generator().manual_seed(2)
    h = sae_codes(E, KW["features"], KW["k"], KW["steps"], KW["lr"], gen)  # the same draws: no AE, no k-means
    picks, _ = greedy_coverage(q, h, 9)
    assert sel.picks == [picks] and sel.selected == sorted(picks)
    assert ((h != 0).sum(1) == KW["k"]).all()  # the trained TopK SAE: exactly K active features


def test_cli_writes_the_selected_rows_and_names_bad_rows(tmp_path, capsys):
    rows = [{"prompt": f"R {i:03d}=", "answer": f"{i:03d}"[::-1], "score": (i % 5) / 4} for i in range(30)]
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "sel.jsonl"
    args = [
        str(src),
        "--out",
        str(out),
        "--budget",
        "12",
        "--quality-field",
        "score",
        "--steps",
        "30",
        "--groups",
        "2",
    ]
    assert main(args) == 0
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(got) == 12 and all(r in rows for r in got)
    assert "12 of 30 rows" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "score": -1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'score' must be a number >= 0"):
        main([str(tmp_path / "bad.jsonl"), "--out", str(out), "--budget", "1", "--quality-field", "score"])


def test_ngram_embeddings_are_normalised_and_similar_texts_are_close():
    E = ngram_embeddings(["R 123=321", "R 124=421", "C 98=98"], dim=64)
    assert torch.allclose(E.norm(dim=1), torch.ones(3, dtype=torch.float64))
    assert float(E[0] @ E[1]) > float(E[0] @ E[2])


def test_chooser_passes_over_the_selection_and_resumes():
    c = MASSChooser([3, 7, 9, 11, 20], want=2)
    c.bind(["t"] * 30, seed=5)
    first = c.next_prompts(1, 3) + c.next_prompts(2, 3)
    assert sorted(first[:5]) == [3, 7, 9, 11, 20] and first[5] in {3, 7, 9, 11, 20}
    other = MASSChooser([3, 7, 9, 11, 20], want=2)
    other.bind(["t"] * 30, seed=5)
    other.load_state_dict(c.state_dict())
    assert other.next_prompts(3, 4) == c.next_prompts(3, 4)
    with pytest.raises(ValueError, match="selection has 5 rows, this run's 2"):
        MASSChooser([1, 2], 2).load_state_dict(c.state_dict())


def test_knobs_refuse_bad_values():
    with pytest.raises(ValueError, match="k=9 must be <= features=8"):
        build_knobs(MASSKnobs, {"k": 9, "features": 8}, "method")
    with pytest.raises(ValueError, match="split='cube'"):
        build_knobs(MASSKnobs, {"split": "cube"}, "method")
