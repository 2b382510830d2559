"""``megarl proxy prune`` on tiny random MoE checkpoints (Qwen3-MoE 8 experts top-2, DeepSeek-V3 with
routing groups, Mixtral): identity, exact MoE outputs on covered tokens, router range, untouched
weights, determinism, group constraints, every bad input, and the source directory left alone."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from megarl.proxy import cluster
from megarl.proxy.hf_expert_files import ProxyInputError
from megarl.proxy.prune import REPORT_NAME, prune_moe_checkpoint
from tests.proxy.helpers import CALIB_TEXTS, build_tiny_moe, dir_digest, write_calib

E, K = 8, 2


def load_tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), "pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def load_hf(d, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    # eager experts: the default grouped-mm kernel has no float64
    return AutoModelForCausalLM.from_pretrained(d, dtype=dtype, experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("proxy")
    src = build_tiny_moe(root / "orig", "qwen3_moe", num_experts=E, top_k=K, layers=2)
    calib = write_calib(root / "calib.jsonl")
    digest = dir_digest(src)
    proxy = root / "proxy4"
    report = prune_moe_checkpoint(src, proxy, 4, str(calib), method="agglomerative", ep_size=2)
    return {"root": root, "src": src, "calib": calib, "digest": digest, "proxy": proxy, "report": report}


@pytest.fixture
def no_model_load(monkeypatch):
    """Bad input must fail before any work: loading the model is an error here."""
    import transformers

    def boom(*a, **k):
        raise AssertionError("model loaded before the input was validated")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)


# ----------------------------------------------------------------------------- structure
def test_identity_is_bit_identical(work):
    out = work["root"] / "identity"
    rep = prune_moe_checkpoint(work["src"], out, E, str(work["calib"]), allow_identity=True)
    a, b = load_tensors(work["src"]), load_tensors(out)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (work["src"] / "config.json").read_text()
    )
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / f).read_bytes() == (work["src"] / f).read_bytes()
    assert all(lr["kept"] == list(range(E)) for lr in rep["layers"])
    assert rep["params_flops"]["total_params"]["ratio"] == 1.0
    ids = torch.tensor([[5, 17, 300, 2, 999, 41]])
    with torch.no_grad():
        assert torch.equal(load_hf(work["src"])(ids).logits, load_hf(out)(ids).logits)


def test_proxy_tensors_and_config(work):
    src, proxy, rep = load_tensors(work["src"]), load_tensors(work["proxy"]), work["report"]
    cfg = json.loads((work["proxy"] / "config.json").read_text())
    assert cfg["num_local_experts"] == 4 and cfg["num_experts_per_tok"] == K
    assert rep["config_changes"] == {"num_local_experts": [E, 4]}
    for lr in rep["layers"]:
        p = f"model.layers.{lr['layer']}.mlp"
        kept = lr["kept"]
        assert kept == sorted(kept) and len(kept) == 4
        # one representative per cluster, clusters partition the experts
        assert sorted(e for c in lr["clusters"] for e in c) == list(range(E))
        assert all(k in c for k, c in zip(kept, lr["clusters"]))
        assert torch.equal(proxy[f"{p}.gate.weight"], src[f"{p}.gate.weight"][kept])
        for j, e in enumerate(kept):
            for w in ("gate_proj", "up_proj", "down_proj"):
                assert torch.equal(proxy[f"{p}.experts.{j}.{w}.weight"], src[f"{p}.experts.{e}.{w}.weight"])
        assert f"{p}.experts.4.gate_proj.weight" not in proxy
    untouched = [k for k in src if ".experts." not in k and ".mlp.gate." not in k]
    assert untouched and all(torch.equal(proxy[k], src[k]) for k in untouched)
    assert set(proxy) - set(untouched) == {k for k in proxy if ".experts." in k or ".mlp.gate." in k}
    # the report's parameter count is the file's
    n_proxy = sum(t.numel() for t in proxy.values())
    assert rep["params_flops"]["total_params"]["proxy"] == n_proxy
    assert rep["params_flops"]["total_params"]["original"] == sum(t.numel() for t in src.values())
    assert json.loads((work["proxy"] / REPORT_NAME).read_text())["layers"] == json.loads(
        json.dumps(rep["layers"])
    )
    # FLOPs: top-k unchanged, so per-token expert FLOPs stay; only the router shrinks
    f = rep["params_flops"]["forward_matmul_flops_per_token"]
    assert f["original"] - f["proxy"] == 2 * 2 * (E - 4) * 64


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_covered_tokens_get_identical_moe_outputs(work, impl):
    """Tokens whose original top-k lies inside the kept set: the same experts in the same order,
    the same renormalised gates up to float32 rounding (the router's softmax always runs in float32
    and its denominator now sums over E' experts), and, given the gates, a bit-identical MoE output
    (kept expert weights are copied bit-exactly and accumulate in the same order)."""
    from transformers import AutoModelForCausalLM

    def load(d):
        return AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float32, experts_implementation=impl
        ).eval()

    orig, proxy = load(work["src"]), load(work["proxy"])
    g = torch.Generator().manual_seed(0)
    checked = 0
    for lr in work["report"]["layers"]:
        l_, kept = lr["layer"], torch.tensor(lr["kept"])
        bo, bp = orig.model.layers[l_].mlp, proxy.model.layers[l_].mlp
        x = torch.randn(2048, 64, generator=g)
        with torch.no_grad():
            _, w_o, i_o = bo.gate(x)
            _, w_p, i_p = bp.gate(x)
            y_o, y_p = bo(x[None])[0], bp(x[None])[0]
            covered = torch.isin(i_o, kept).all(-1)
            xc = x[covered]
            # the original experts with the proxy's gates vs the proxy's whole block: bit-identical
            y_o_with_proxy_gates = bo.experts(xc, i_o[covered], w_p[covered])
        assert int(i_p.min()) >= 0 and int(i_p.max()) < 4
        assert covered.sum() > 50
        assert torch.equal(kept[i_p[covered]], i_o[covered])  # same experts, same order
        eps = torch.finfo(torch.float32).eps
        assert float(((w_p[covered] - w_o[covered]).abs() / w_o[covered]).max()) <= 4 * eps
        assert torch.equal(y_p[covered], y_o_with_proxy_gates)
        torch.testing.assert_close(y_p[covered], y_o[covered], rtol=1e-5, atol=1e-6)
        # and the uncovered ones do change (the test can fail)
        assert not torch.allclose(y_p[~covered], y_o[~covered], rtol=1e-3, atol=1e-3)
        checked += int(covered.sum())
    assert checked > 100


def test_router_indices_in_range_in_full_model(work):
    proxy = load_hf(work["proxy"])
    seen = []
    hooks = [
        layer.mlp.experts.register_forward_pre_hook(lambda m, a: seen.append(a[1].clone()))
        for layer in proxy.model.layers
    ]
    with torch.no_grad():
        proxy(torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(1)))
    for h in hooks:
        h.remove()
    assert len(seen) == 2 and all(int(s.min()) >= 0 and int(s.max()) < 4 for s in seen)


def test_report_contents(work):
    rep = work["report"]
    assert rep["num_experts"] == {"original": E, "proxy": 4} and rep["experts_per_ep_rank"] == 2
    assert rep["calibration"]["tokens"] > 100
    for lr in rep["layers"]:
        c = lr["coverage"]
        assert 0 < c["tokens_fully_covered"] <= c["token_assignments_covered"] <= 1
        assert 0 < c["routing_mass_covered"] <= 1
        freqs = [row["freq"] for row in lr["experts"]]
        assert abs(sum(freqs) - K) < 1e-4  # k assignments per token
        # mass rule: each kept expert has the largest mass share of its cluster
        share = {row["expert"]: row["mass_share"] for row in lr["experts"]}
        assert all(share[k] == max(share[e] for e in c) for k, c in zip(lr["kept"], lr["clusters"]))


def test_statistics_match_a_direct_computation(work):
    """Routing counts / mass, output signatures over ALL tokens and saliency, recomputed by hand
    from the checkpoint's expert weights and the router applied to the captured MoE inputs."""
    import torch.nn.functional as F

    from megarl.proxy.stats import collect_expert_stats, tokenize_calibration

    model = load_hf(work["src"])
    seqs = tokenize_calibration(CALIB_TEXTS[:8], str(work["src"]), 1024, 300, seq_len=64)
    inputs: dict[int, list] = {0: [], 1: []}
    hooks = [
        model.model.layers[i].mlp.register_forward_pre_hook(lambda m, a, i=i: inputs[i].append(a[0][0]))
        for i in (0, 1)
    ]
    stats = collect_expert_stats(model, seqs, [0, 1])
    for h in hooks:
        h.remove()
    w = load_tensors(work["src"])
    for layer in (0, 1):
        x = torch.cat(inputs[layer])  # [T, H]
        st = stats[layer]
        assert st.tokens == x.shape[0] == sum(len(s) for s in seqs)
        p = f"model.layers.{layer}.mlp"
        probs = torch.softmax(x @ w[f"{p}.gate.weight"].T, -1)
        top_v, top_i = probs.topk(K, -1)
        gates = top_v / top_v.sum(-1, keepdim=True)
        assert torch.equal(st.topk, top_i)
        for e in range(E):
            ye = F.linear(
                F.silu(F.linear(x, w[f"{p}.experts.{e}.gate_proj.weight"]))
                * F.linear(x, w[f"{p}.experts.{e}.up_proj.weight"]),
                w[f"{p}.experts.{e}.down_proj.weight"],
            )
            np.testing.assert_allclose(st.out_signature[e], ye.double().mean(0).numpy(), rtol=1e-4, atol=1e-6)
            routed = top_i == e
            assert st.count[e] == int(routed.sum())
            g = (gates * routed).sum(-1)
            np.testing.assert_allclose(st.mass[e], float(g.sum()), rtol=1e-5)
            tok = routed.any(-1)
            want = float((g[tok] * ye[tok].norm(dim=-1)).mean()) if tok.any() else 0.0
            np.testing.assert_allclose(st.saliency[e], want, rtol=1e-4)


# ----------------------------------------------------------------------------- clustering
def test_agglomerative_known_answer():
    pts = np.array([[0.0], [0.1], [0.15], [5.0], [5.2], [9.0]])
    d = np.abs(pts - pts.T)
    assert cluster.agglomerative(d, 3) == [[0, 1, 2], [3, 4], [5]]
    assert cluster.agglomerative(d, 6) == [[i] for i in range(6)]


def test_kmeans_deterministic_and_complete():
    rng = np.random.default_rng(3)
    phi = cluster._unit_rows(rng.normal(size=(16, 10)))
    a = cluster.kmeans(phi, 5, seed=7)
    assert a == cluster.kmeans(phi, 5, seed=7)
    assert len(a) == 5 and all(a) and sorted(e for c in a for e in c) == list(range(16))


def test_prune_deterministic_under_seed(work):
    runs = [
        prune_moe_checkpoint(
            work["src"], work["root"] / f"km{i}", 4, str(work["calib"]), method="kmeans", seed=11
        )["layers"]
        for i in range(2)
    ]
    assert [lr["clusters"] for lr in runs[0]] == [lr["clusters"] for lr in runs[1]]
    a, b = load_tensors(work["root"] / "km0"), load_tensors(work["root"] / "km1")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_group_limited_routing_deepseek(tmp_path):
    src = build_tiny_moe(tmp_path / "ds", "deepseek_v3", num_experts=8, top_k=2)  # n_group=2, topk_group=1
    calib = write_calib(tmp_path / "c.jsonl")
    for method in ("agglomerative", "kmeans"):
        out = tmp_path / f"ds4-{method}"
        rep = prune_moe_checkpoint(src, out, 4, calib, method=method)  # a Path works too
        s, p = load_tensors(src), load_tensors(out)
        for lr in rep["layers"]:
            assert all(len({e // 4 for e in c}) == 1 for c in lr["clusters"])  # no cluster crosses a group
            assert [sum(1 for e in lr["kept"] if e // 4 == g) for g in range(2)] == [2, 2]
            pre = f"model.layers.{lr['layer']}.mlp"
            b = s[f"{pre}.gate.e_score_correction_bias"]
            assert torch.equal(p[f"{pre}.gate.e_score_correction_bias"], b[lr["kept"]])
            assert torch.equal(
                p[f"{pre}.shared_experts.up_proj.weight"], s[f"{pre}.shared_experts.up_proj.weight"]
            )
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["n_routed_experts"] == 4 and cfg["n_group"] == 2 and cfg["topk_group"] == 1
        assert rep["calibration"]["source"] == str(calib)
        with torch.no_grad():
            assert torch.isfinite(load_hf(out)(torch.tensor([[3, 4, 5, 6]])).logits).all()
    with pytest.raises(ProxyInputError, match="not divisible by n_group=2"):
        prune_moe_checkpoint(src, tmp_path / "x", 3, str(calib))
    with pytest.raises(ProxyInputError, match="1 expert\\(s\\) per routing group"):
        prune_moe_checkpoint(src, tmp_path / "x", 2, str(calib))


def test_mixtral_prunes_and_loads(tmp_path):
    src = build_tiny_moe(tmp_path / "mx", "mixtral", num_experts=8, top_k=2)
    out = tmp_path / "mx2"
    rep = prune_moe_checkpoint(src, out, np.int64(2), CALIB_TEXTS)
    p = load_tensors(out)
    assert {k for k in p if "experts.1.w1" in k} and not {k for k in p if "experts.2." in k}
    assert json.loads((out / "config.json").read_text())["num_local_experts"] == 2
    assert rep["calibration"]["source"].startswith("list of")
    with torch.no_grad():
        assert torch.isfinite(load_hf(out)(torch.tensor([[3, 4, 5]])).logits).all()


# ----------------------------------------------------------------------------- bad input
def _expect(match, fn, out):
    with pytest.raises(ProxyInputError, match=match):
        fn()
    assert not os.path.exists(out) and not os.path.exists(str(out) + ".tmp-proxy")


def test_bad_inputs_fail_before_any_work(work, tmp_path, no_model_load):
    src, calib, out = work["src"], str(work["calib"]), tmp_path / "out"
    cases = [
        ("exceeds the model's 8 routed experts", {"num_experts": 9}),
        ("equals the model's expert count", {"num_experts": 8}),
        ("below num_experts_per_tok=2", {"num_experts": 1}),
        ("not divisible by --ep-size 4", {"num_experts": 6, "ep_size": 4}),
        ("--method 'spectral'", {"method": "spectral"}),
        ("calibration file .*nope.jsonl: not found", {"calib": str(tmp_path / "nope.jsonl")}),
    ]
    for match, kw in cases:
        args = {"num_experts": 4, "calib": calib} | kw
        n, c = args.pop("num_experts"), args.pop("calib")
        _expect(match, lambda n=n, c=c, args=args: prune_moe_checkpoint(src, out, n, c, **args), out)
    (tmp_path / "empty.jsonl").write_text("\n")
    _expect("empty", lambda: prune_moe_checkpoint(src, out, 4, str(tmp_path / "empty.jsonl")), out)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no field"}\n')
    _expect(
        "bad.jsonl: row 2 has no string field text or prompt",
        lambda: prune_moe_checkpoint(src, out, 4, str(tmp_path / "bad.jsonl")),
        out,
    )
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"\n')
    _expect(
        "broken.jsonl: row 1 is not valid JSON",
        lambda: prune_moe_checkpoint(src, out, 4, str(tmp_path / "broken.jsonl")),
        out,
    )
    _expect(
        "config.json: expected a JSON list of strings",
        lambda: prune_moe_checkpoint(src, out, 4, str(work["src"] / "config.json")),
        out,
    )
    (tmp_path / "c.csv").write_text("text\nhello\n")
    _expect("c.csv: unknown format", lambda: prune_moe_checkpoint(src, out, 4, str(tmp_path / "c.csv")), out)
    _expect(
        "calibration list: no calibration text", lambda: prune_moe_checkpoint(src, out, 4, ["  ", "\n"]), out
    )
    _expect("calibration list item 1 is int", lambda: prune_moe_checkpoint(src, out, 4, ["a", 3]), out)
    # the output exists already / lies inside the source
    existing = tmp_path / "exists"
    existing.mkdir()
    with pytest.raises(ProxyInputError, match="exists; refusing to overwrite"):
        prune_moe_checkpoint(src, existing, 4, calib)
    _expect(
        "inside the source model directory",
        lambda: prune_moe_checkpoint(src, src / "sub", 4, calib),
        src / "sub",
    )


def test_bad_model_dirs(tmp_path, no_model_load):
    calib, out = CALIB_TEXTS, tmp_path / "out"
    _expect("not a directory", lambda: prune_moe_checkpoint(tmp_path / "missing", out, 2, calib), out)
    (tmp_path / "noconf").mkdir()
    _expect(
        "noconf/config.json: missing", lambda: prune_moe_checkpoint(tmp_path / "noconf", out, 2, calib), out
    )
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "hidden_size": 64, "vocab_size": 1024})
    )
    _expect("dense model", lambda: prune_moe_checkpoint(dense, out, 2, calib), out)
    # MoE config but no weights
    moe = tmp_path / "noweights"
    moe.mkdir()
    (moe / "config.json").write_text(
        json.dumps(
            {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1024}
        )
    )
    _expect("no \\*.safetensors weight file", lambda: prune_moe_checkpoint(moe, out, 4, calib), out)


def test_bad_checkpoint_contents(work, tmp_path, no_model_load):
    out = tmp_path / "out"
    # config says 16 experts, weights hold 8
    lie = tmp_path / "lie"
    shutil.copytree(work["src"], lie)
    cfg = json.loads((lie / "config.json").read_text())
    cfg["num_local_experts"] = 16
    (lie / "config.json").write_text(json.dumps(cfg))
    _expect(
        "gate.weight' has shape \\[8, 64\\]; expected leading dimension num_experts=16",
        lambda: prune_moe_checkpoint(lie, out, 4, CALIB_TEXTS),
        out,
    )
    # no tokenizer
    notok = tmp_path / "notok"
    shutil.copytree(work["src"], notok, ignore=shutil.ignore_patterns("tokenizer*"))
    _expect("no usable tokenizer", lambda: prune_moe_checkpoint(notok, out, 4, CALIB_TEXTS), out)
    # tokenizer whose ids exceed the model's vocabulary
    small = tmp_path / "smallvocab"
    shutil.copytree(work["src"], small)
    cfg = json.loads((small / "config.json").read_text())
    cfg["vocab_size"] = 8
    (small / "config.json").write_text(json.dumps(cfg))
    _expect("outside the model's vocab_size=8", lambda: prune_moe_checkpoint(small, out, 4, CALIB_TEXTS), out)


def test_clamp_topk_records_warning(work):
    out = work["root"] / "clamped"
    rep = prune_moe_checkpoint(work["src"], out, 1, str(work["calib"]), clamp_topk=True)
    assert rep["top_k"] == {"original": 2, "proxy": 1}
    assert any("top-k clamped from 2 to 1" in w for w in rep["warnings"])
    assert json.loads((out / "config.json").read_text())["num_experts_per_tok"] == 1


# ----------------------------------------------------------------------------- CLI
def test_cli_prune_and_errors(work, capsys, monkeypatch):
    from megarl import cli
    from megarl.proxy import proxy_cli

    out = work["root"] / "cli2"
    rc = cli.main(
        [
            "proxy",
            "prune",
            "--model",
            str(work["src"]),
            "--experts",
            "2",
            "--calib",
            str(work["calib"]),
            "--out",
            str(out),
            "--method",
            "kmeans",
            "--seed",
            "3",
            "--ep-size",
            "2",
        ]
    )
    assert rc == 0 and (out / REPORT_NAME).exists()
    assert "proxy written to" in capsys.readouterr().out
    rc = cli.main(
        [
            "proxy",
            "prune",
            "--model",
            str(work["src"]),
            "--experts",
            "3",
            "--calib",
            str(work["calib"]),
            "--out",
            str(work["root"] / "cli3"),
            "--ep-size",
            "2",
        ]
    )
    assert rc == 2 and "not divisible by --ep-size 2" in capsys.readouterr().err
    monkeypatch.setitem(proxy_cli.DELEGATED, "replay", "megarl.proxy.no_such_module")
    assert proxy_cli.main(["replay", "x"]) == 2
    assert "not available" in capsys.readouterr().err


def test_source_directory_unchanged(work):
    """Runs last in this module (pytest keeps file order): nothing above touched the original."""
    assert dir_digest(work["src"]) == work["digest"]


def test_keeping_no_more_experts_than_top_k_warns_that_routing_no_longer_selects():
    from megarl.proxy.hf_expert_files import MoEConfig
    from megarl.proxy.prune import check_request

    cfg = MoEConfig(model_type="qwen3_moe", num_experts=8, top_k=2)
    k, warns = check_request(cfg, 2, 2, clamp_topk=False, allow_identity=False)
    assert k == 2 and any("every token is routed to all 2 kept experts" in w for w in warns), warns
    assert check_request(cfg, 4, 2, clamp_topk=False, allow_identity=False)[1] == []
