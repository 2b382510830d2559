"""``megarl proxy {prune,replay,compare,demo-inputs}``.

``prune`` lives here (megarl.proxy.prune); ``replay``, ``compare`` and ``demo-inputs`` are
dispatched to ``main(argv)`` of megarl.proxy.replay, megarl.proxy.compare and
megarl.proxy.demo_inputs, imported only when asked for.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

USAGE = """usage: megarl proxy <command> [args...]

commands:
  prune     cluster each MoE layer's experts and keep one per cluster (a smaller HF checkpoint)
  replay    re-run a dumped training step on a model and report the detectors
  compare   run one recipe on the original and the proxy and write a fidelity report
  demo-inputs  write a tiny random-weight MoE and a calibration file (the docs/proxy.md walk-through)
"""

DELEGATED = {
    "replay": "megarl.proxy.replay",
    "compare": "megarl.proxy.compare",
    "demo-inputs": "megarl.proxy.demo_inputs",
}


def prune_parser() -> argparse.ArgumentParser:
    """Arguments of ``megarl proxy prune``."""
    p = argparse.ArgumentParser(
        prog="megarl proxy prune",
        description="Build a proxy MoE: per MoE layer cluster the routed experts into E' "
        "groups and keep one representative per group, bit-exactly.",
    )
    p.add_argument(
        "--model", required=True, help="HF model directory (config.json, *.safetensors, tokenizer)"
    )
    p.add_argument("--experts", required=True, type=int, help="E': routed experts kept per MoE layer")
    p.add_argument(
        "--calib", required=True, help="calibration data: .jsonl (text or prompt field), .json list, .txt"
    )
    p.add_argument("--out", required=True, help="output directory (must not exist; written atomically)")
    p.add_argument("--method", default="agglomerative", choices=["agglomerative", "kmeans"])
    p.add_argument(
        "--seed", type=int, default=0, help="k-means++ seed (agglomerative is deterministic anyway)"
    )
    p.add_argument(
        "--ep-size", type=int, default=1, help="expert-parallel size the proxy will run at (E' %% ep == 0)"
    )
    p.add_argument("--max-calib-tokens", type=int, default=4096)
    p.add_argument(
        "--representative",
        default="mass",
        choices=["mass", "medoid"],
        help="which expert of a cluster is kept: highest routing mass (default) or the medoid",
    )
    p.add_argument("--kappa", type=float, default=1.0, help="weight of the router row in the expert features")
    p.add_argument(
        "--clamp-topk", action="store_true", help="allow E' < top-k by setting top-k to E' (recorded)"
    )
    p.add_argument("--allow-identity", action="store_true", help="allow E' = E (an unpruned control copy)")
    return p


def prune_main(argv: list[str]) -> int:
    """Run ``megarl proxy prune``; prints a short summary, exits 2 on bad input."""
    from megarl.proxy.hf_expert_files import ProxyInputError
    from megarl.proxy.prune import REPORT_NAME, prune_moe_checkpoint

    a = prune_parser().parse_args(argv)
    try:
        rep = prune_moe_checkpoint(
            a.model,
            a.out,
            a.experts,
            a.calib,
            method=a.method,
            seed=a.seed,
            ep_size=a.ep_size,
            max_calib_tokens=a.max_calib_tokens,
            representative=a.representative,
            kappa=a.kappa,
            clamp_topk=a.clamp_topk,
            allow_identity=a.allow_identity,
        )
    except ProxyInputError as e:
        print(f"megarl proxy prune: error: {e}", file=sys.stderr)
        return 2
    pf = rep["params_flops"]
    print(
        f"proxy written to {a.out} "
        f"({rep['num_experts']['original']} -> {rep['num_experts']['proxy']} experts, "
        f"{len(rep['layers'])} MoE layers, {rep['calibration']['tokens']} calibration tokens)"
    )
    print(
        json.dumps(
            {
                "coverage_mean": rep["coverage_mean"],
                "total_params_ratio": pf["total_params"]["ratio"],
                "flops_per_token_ratio": pf["forward_matmul_flops_per_token"]["ratio"],
                "warnings": rep["warnings"],
            },
            indent=1,
        )
    )
    print(f"report: {a.out}/{REPORT_NAME}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``megarl proxy <command>``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "prune":
        return prune_main(rest)
    if cmd in DELEGATED:
        try:
            mod = importlib.import_module(DELEGATED[cmd])
        except ModuleNotFoundError as e:
            if e.name != DELEGATED[cmd]:
                raise
            print(
                f"megarl proxy {cmd}: not available in this installation ({DELEGATED[cmd]} is missing)",
                file=sys.stderr,
            )
            return 2
        return int(mod.main(rest) or 0)
    print(f"megarl proxy: unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
