"""What a proxy saves, at a scale where experts dominate, and whether faults still show on it.

    .venv/bin/python benchmarks/proxy_savings.py --out runs/proxy-savings   # 475 s measured, 2 busy cores

1. Writes a random-weight Qwen3-MoE whose routed experts hold almost all parameters (default: 64
   experts, top-4, 4 layers, hidden 512, expert width 512: 205 M parameters) with megarl's char
   tokenizer, and calibration text (the reverse task's prompts and answers).
2. Prunes it with ``megarl proxy prune`` to ``--proxy-experts`` (default 8: 8x fewer) at EP=2.
3. Trains both with ``megarl proxy compare`` for ``--steps`` GRPO steps of tests/faults/recipe.yaml
   (2 optimizer steps per step, so an LR spike shows in its own step's second update; learning rate
   ``--lr``, 1e-5: the recipe's 1e-3, tuned for a toy, collapses the entropy of a random 200 M model
   within a few steps, the proxy's first), each under
   ``torchrun`` with 2 processes and expert parallelism 2, with three faults injected:
   a token poison (step 4), NaN written into the weights of one routed expert held by EP rank 1 for
   one step (step 6; the same expert in both models: the proxy keeps it bit-exactly under another
   id, read from the prune report), and a learning-rate spike (step 8).
4. Prints, proxy / original: parameters, peak memory (max RSS of the largest worker), mean step
   time and learner time per step (steps that wrote a dump left out; this run writes none), and per
   fault the detector events of both runs at its step and the next; then the fidelity verdict.
   ``OUT/savings.json`` keeps the figures, ``OUT/cmp/fidelity.md`` the full report.

``--tiny`` runs the same path on an 8-expert toy (8 -> 4 experts, hidden 64) in 2-3 minutes;
``--summary --out OUT`` prints the figures of a finished run again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "tests" / "faults" / "recipe.yaml"
LAYER = "decoder.layers.0.mlp"


def write_model(out: Path, experts: int, top_k: int, layers: int, hidden: int, width: int, seed: int) -> int:
    """A random-weight Qwen3-MoE with the char tokenizer in ``out``; returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from megarl.data.tokenizer import CharTokenizer
    from megarl.proxy.demo_inputs import ALPHABET, write_char_tokenizer

    ct = CharTokenizer(ALPHABET)
    torch.manual_seed(seed)
    heads = max(hidden // 64, 2)
    cfg = Qwen3MoeConfig(
        vocab_size=ct.vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * width,
        moe_intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=hidden // heads,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        max_position_embeddings=64,
        router_aux_loss_coef=0.01,
        tie_word_embeddings=False,
        bos_token_id=ct.bos_id,
        eos_token_id=ct.eos_id,
        pad_token_id=ct.pad_id,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(out))
    write_char_tokenizer(out)
    return sum(p.numel() for p in model.parameters())


def faulty_expert(report: dict) -> tuple[int, int]:
    """(original id, proxy id) of one expert the proxy keeps in layer 0, held by the last EP rank in
    both models where possible: the proxy's last expert, i.e. the highest kept original id."""
    layer0 = next(lr for lr in report["layers"] if lr["layer"] == 0)
    original = max(layer0["kept"])
    return original, layer0["new_index"][str(original)]


def injections(expert: int, poison_step: int, nan_step: int, lr_step: int, lr_scale: float) -> str:
    """The ``faults.inject`` override: token poison, one expert's weights NaN, an LR spike."""
    return (
        "faults.inject=["
        f"{{kind: poison, field: tokens, fraction: 0.3, step: {poison_step}}}, "
        f"{{kind: nan, where: weight, target: {LAYER}, expert: {expert}, fraction: 0.01, step: {nan_step}}}, "
        f"{{kind: lr, scale: {lr_scale}, step: {lr_step}}}]"
    )


def main(argv: list[str] | None = None) -> int:
    """Build, prune, train both with faults, print the savings and the fault agreement."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/proxy-savings", help="output directory (must not exist)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert-width", type=int, default=512)
    ap.add_argument("--proxy-experts", type=int, default=8)
    ap.add_argument(
        "--steps", type=int, default=8, help="training steps (the LR spike at 8 wrecks the weights)"
    )
    ap.add_argument("--nproc", type=int, default=2, help="processes per run; expert parallelism = this")
    ap.add_argument(
        "--lr", type=float, default=1.0e-5, help="learning rate (the recipe's 1e-3 collapses a 200 M model)"
    )
    ap.add_argument("--lr-scale", type=float, default=1000.0, help="the LR spike: lr x this at step 8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="8 experts top-2, hidden 64, 4-expert proxy")
    ap.add_argument("--summary", action="store_true", help="print the figures of the finished run in --out")
    a = ap.parse_args(argv)
    if a.summary:
        return summary_main(Path(a.out))
    if a.tiny:
        a.experts, a.top_k, a.layers, a.hidden, a.expert_width, a.proxy_experts = 8, 2, 2, 64, 32, 4
    out = Path(a.out)
    if out.exists():
        print(f"proxy_savings: {out} exists; remove it or pick another --out", file=sys.stderr)
        return 2
    if a.steps < 8:
        print("proxy_savings: --steps must be >= 8 (faults at steps 4, 6 and 8)", file=sys.stderr)
        return 2
    out.mkdir(parents=True)
    from megarl.data.tasks import generate_task_files
    from megarl.proxy.compare import run_compare
    from megarl.proxy.demo_inputs import write_calibration

    t0 = time.time()
    n = write_model(out / "original", a.experts, a.top_k, a.layers, a.hidden, a.expert_width, a.seed)
    write_calibration(out / "calib.jsonl")
    generate_task_files("reverse", out / "data" / "train.jsonl", out / "data" / "eval.jsonl", 200, 8, 3, 0)
    print(f"original: {a.experts} experts, top-{a.top_k}, {a.layers} layers, {n / 1e6:.1f} M parameters")
    t1 = time.time()
    prune = [sys.executable, "-m", "megarl.cli", "proxy", "prune", "--model", str(out / "original")]
    prune += [
        "--experts",
        str(a.proxy_experts),
        "--calib",
        str(out / "calib.jsonl"),
        "--out",
        str(out / "proxy"),
    ]
    prune += ["--ep-size", str(a.nproc), "--max-calib-tokens", "2048"]
    subprocess.run(prune, check=True, stdout=subprocess.DEVNULL)
    prune_s = time.time() - t1
    report = json.loads((out / "proxy" / "proxy_report.json").read_text())
    orig_e, proxy_e = faulty_expert(report)
    rank_o, rank_p = orig_e // (a.experts // a.nproc), proxy_e // (a.proxy_experts // a.nproc)
    print(
        f"proxy: {a.proxy_experts} experts ({a.experts // a.proxy_experts}x fewer), pruned in "
        f"{prune_s:.1f} s; faulty expert: {orig_e} of the original (EP rank {rank_o}) = {proxy_e} "
        f"of the proxy (EP rank {rank_p})"
    )
    steps = FAULT_STEPS
    common = [
        f"data.train={out / 'data' / 'train.jsonl'}",
        f"data.eval={out / 'data' / 'eval.jsonl'}",
        f"parallel.ep={a.nproc}",
        "schedule.mini_batches=2",
        f"optimizer.lr={a.lr}",
        "faults.detectors.logprob_gap_max=1.0e-4",
    ]
    fault = (steps["token poison"], steps["expert weights NaN"], steps["LR spike"], a.lr_scale)
    t2 = time.time()
    rep = run_compare(
        str(RECIPE),
        str(out / "original"),
        str(out / "proxy"),
        a.steps,
        str(out / "cmp"),
        [*common, injections(orig_e, *fault)],
        nproc_per_node=a.nproc,
        proxy_overrides=[injections(proxy_e, *fault)],
    )
    compare_s = time.time() - t2
    meta = {
        "model": vars(a),
        "parameters": n,
        "prune_s": round(prune_s, 1),
        "compare_s": round(compare_s, 1),
        "total_s": round(time.time() - t0, 1),
        "faulty_expert": {
            "original": orig_e,
            "original_ep_rank": rank_o,
            "proxy": proxy_e,
            "proxy_ep_rank": rank_p,
        },
    }
    summarize(out, meta, rep)
    return 0


FAULT_STEPS = {"token poison": 4, "expert weights NaN": 6, "LR spike": 8}


def _ratio(x, y):
    return None if not x or y is None else y / x


def summarize(out: Path, meta: dict, rep: dict) -> dict:
    """Print the cost table, the events at each fault's step (and the next), the verdict and the
    per-curve agreement of the fidelity report ``rep``; write ``out/savings.json``."""
    runs, cost = rep["runs"], rep["cost"]
    rows = {
        "parameters": (runs["original"]["params"], runs["proxy"]["params"]),
        "peak RSS MiB (largest worker)": (runs["original"]["peak_rss_mib"], runs["proxy"]["peak_rss_mib"]),
        "step time s (mean, no dump steps)": (
            cost["original"]["step_time_mean_s"],
            cost["proxy"]["step_time_mean_s"],
        ),
        "learner time s per step (mean, no dump steps)": (
            cost["original"]["train_time_mean_s"],
            cost["proxy"]["train_time_mean_s"],
        ),
        "run wall time s": (runs["original"]["wall_s"], runs["proxy"]["wall_s"]),
    }
    print("\n| | original | proxy | proxy / original |\n|---|---|---|---|")
    for k, (x, y) in rows.items():
        r = _ratio(x, y)
        print(f"| {k} | {x:.4g} | {y:.4g} | {'n/a' if r is None else f'{r:.3f}'} |")
    print(cost["note"])
    ev: dict[str, dict[int, list[str]]] = {"original": {}, "proxy": {}}
    for name, by_step in ev.items():
        for s, t in rep["events"][name]:
            by_step.setdefault(int(s), []).append(t)
    last = meta["model"]["steps"]
    print("\n| fault | step | original events | proxy events | on both |\n|---|---|---|---|---|")
    faults = []
    for label, s in FAULT_STEPS.items():
        for at in [s, s + 1] if s < last else [s]:
            o, p = sorted(set(ev["original"].get(at, []))), sorted(set(ev["proxy"].get(at, [])))
            both = sorted(set(o) & set(p))
            faults.append({"fault": label, "step": at, "original": o, "proxy": p, "on_both": both})
            cells = [", ".join(x) or "-" for x in (o, p, both)]
            print(f"| {label} | {at} | {' | '.join(cells)} |")
    print(f"\nall events: original {rep['events']['original']}; proxy {rep['events']['proxy']}")
    print(f"verdict: {rep['verdict']}")
    cov = rep.get("routing_coverage") or {}
    print(
        f"routing mass kept {cov.get('routing_mass_covered')}, tokens with all experts kept "
        f"{cov.get('tokens_fully_covered')} (prune report, calibration tokens)"
    )
    for c in rep["curves"]:
        w = c["worst_step_ratio"]
        print(
            f"  {c['label']:<46} spearman={c['spearman_rho']}  r w/o fault steps="
            f"{c['pearson_r_without_fault_steps']}  mean ratio={c['mean_ratio']}  "
            f"worst step ratio={w['ratio'] if w else None} (step {w['step'] if w else '-'})"
        )
    summary = {
        **meta,
        "figures": {k: {"original": x, "proxy": y, "ratio": _ratio(x, y)} for k, (x, y) in rows.items()},
        "faults": faults,
        "verdict": rep["verdict"],
        "routing_coverage": cov,
    }
    (out / "savings.json").write_text(json.dumps(summary, indent=1))
    print(f"\nfigures: {out / 'savings.json'}; fidelity report: {out / 'cmp' / 'fidelity.md'}")
    print(f"{meta['total_s']} s in all (prune {meta['prune_s']} s, both trainings {meta['compare_s']} s)")
    return summary


def summary_main(out: Path) -> int:
    """``--summary OUT``: print the figures of a finished run again from its files."""
    meta = json.loads((out / "savings.json").read_text())
    meta = {k: meta[k] for k in ("model", "parameters", "prune_s", "compare_s", "total_s", "faulty_expert")}
    summarize(out, meta, json.loads((out / "cmp" / "fidelity.json").read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
