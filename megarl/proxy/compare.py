"""``megarl proxy compare``: one recipe on the original and on the proxy, and a fidelity report.

    megarl proxy compare --config RECIPE.yaml --original HF_DIR --proxy HF_DIR --steps N --out DIR \\
        [--set section.key=value ...] [--nproc-per-node N] [--proxy-nproc-per-node M] \\
        [--proxy-set section.key=value ...]

Each run is ``megarl train RECIPE model.hf_dir=<dir> logging.run_dir=DIR/<name> schedule.steps=N
checkpoint.resume=never`` plus the ``--set`` overrides (both runs get the same ones, including any
``faults.inject``), in its own process, one after the other (``--parallel``: both at once), or
under ``torchrun`` with ``--nproc-per-node N`` processes so it runs at the fault's layout
(``--set parallel.ep=2`` etc.); ``--proxy-nproc-per-node`` and ``--proxy-set`` give the proxy its own,
smaller layout. Its output goes to ``DIR/<name>.log``,
its peak memory (max RSS of the process) and wall time into the report. Then
megarl.faults.fidelity writes ``DIR/fidelity.md``, ``fidelity.png`` and ``fidelity.json``.

Checked before any run: the recipe loads with the overrides, both directories are HF checkpoints,
and the proxy has the original's backbone (vocabulary, layers, hidden size, heads; only the routed
experts may differ); the recipe is checked with each model and its layout (``megarl train --check``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megarl.faults.dump import DumpError, check_compatible, model_shape


class CompareError(ValueError):
    """Bad input to ``megarl proxy compare`` (named), found before any run starts."""


def _count_params(hf_dir: str) -> int:
    from safetensors import safe_open

    n = 0
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                shape = fh.get_slice(k).get_shape()
                p = 1
                for s in shape:
                    p *= int(s)
                n += p
    return n


def _check_recipe(config: str, hf_dir: str, steps: int, overrides: list[str], what: str) -> None:
    """``megarl train --check`` of the recipe on ``hf_dir`` with ``overrides``; CompareError naming
    ``what`` (the options that gave the overrides) on a config error."""
    check = subprocess.run(
        [
            sys.executable,
            "-m",
            "megarl.cli",
            "train",
            config,
            f"model.hf_dir={hf_dir}",
            f"schedule.steps={steps}",
            *overrides,
            "--check",
        ],
        capture_output=True,
        text=True,
    )
    if check.returncode != 0:
        msg = (
            check.stderr.strip().splitlines()[-1] if check.stderr.strip() else f"exit code {check.returncode}"
        )
        raise CompareError(f"{what}: {msg.removeprefix('megarl train: config error: ')}")


def check_inputs(
    config: str,
    original: str,
    proxy: str,
    steps: int,
    overrides: list[str],
    proxy_overrides: list[str] | None = None,
    nprocs: tuple[int, int] = (1, 1),
) -> dict:
    """Validate everything ``run_compare`` needs; returns both models' shapes."""
    if steps < 1:
        raise CompareError(f"--steps {steps}: must be >= 1")
    for opt, n in zip(("--nproc-per-node", "--proxy-nproc-per-node"), nprocs):
        if n < 1:
            raise CompareError(f"{opt} {n}: must be >= 1")
    # the recipe is checked by the command that will run it (`megarl train --check`)
    _check_recipe(config, original, steps, overrides, f"--config {config}")
    shapes = {}
    for name, d in (("original", original), ("proxy", proxy)):
        if not (Path(d) / "config.json").is_file():
            raise CompareError(f"--{name} {d}: no config.json (not a HF checkpoint directory)")
        if not list(Path(d).glob("*.safetensors")):
            raise CompareError(f"--{name} {d}: no *.safetensors weights")
        shapes[name] = model_shape(json.loads((Path(d) / "config.json").read_text()))
    try:
        check_compatible(
            shapes["original"], json.loads((Path(proxy) / "config.json").read_text()), proxy, ref="original"
        )
    except DumpError as e:
        raise CompareError(f"--proxy is not a proxy of --original: {e}") from None
    if proxy_overrides:
        _check_recipe(
            config,
            proxy,
            steps,
            overrides + proxy_overrides,
            f"--config {config} with --proxy-set on --proxy",
        )
    else:
        _check_recipe(config, proxy, steps, overrides, f"--config {config} on --proxy {proxy}")
    return shapes


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_cmd(
    config: str, hf_dir: str, run_dir: Path, steps: int, overrides: list[str], nproc: int = 1
) -> list[str]:
    launch = (
        [
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
        ]
        if nproc > 1
        else []
    )
    return [
        sys.executable,
        *launch,
        "-m",
        "megarl.cli",
        "train",
        config,
        f"model.hf_dir={hf_dir}",
        f"logging.run_dir={run_dir}",
        f"schedule.steps={steps}",
        "checkpoint.resume=never",
        *overrides,
    ]


def run_trainings(
    jobs: dict[str, list[str]], logs: dict[str, Path], parallel: bool = False
) -> dict[str, dict]:
    """Run ``megarl train`` commands (name -> argv), one after the other or all at once; returns
    per name the exit code, wall time and peak RSS (MiB) of the process or, under torchrun, of
    its largest worker."""
    out: dict[str, dict] = {}
    pending = list(jobs.items())
    while pending:
        batch = pending if parallel else pending[:1]
        pending = [] if parallel else pending[1:]
        with contextlib.ExitStack() as stack:
            procs = {}
            for name, cmd in batch:
                fh = stack.enter_context(open(logs[name], "w"))
                fh.write(" ".join(cmd) + "\n")
                fh.flush()
                procs[name] = (
                    subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ)),
                    time.time(),
                )
            for name, (p, t0) in procs.items():
                _, status, usage = os.wait4(p.pid, 0)
                p.returncode = os.waitstatus_to_exitcode(status)
                out[name] = {
                    "exit_code": p.returncode,
                    "wall_s": round(time.time() - t0, 2),
                    "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
                }
    return out


def run_compare(
    config: str,
    original: str,
    proxy: str,
    steps: int,
    out: str,
    overrides: list[str] | None = None,
    parallel: bool = False,
    nproc_per_node: int = 1,
    proxy_nproc_per_node: int | None = None,
    proxy_overrides: list[str] | None = None,
) -> dict:
    """Both runs, then the fidelity report; returns the report (megarl.faults.fidelity).
    ``parallel``: train both at once (faster with spare cores; time and memory figures then
    include the contention). ``nproc_per_node`` > 1 runs each under torchrun (the layout comes
    from ``parallel.*`` overrides); ``proxy_nproc_per_node`` / ``proxy_overrides`` (applied after
    ``overrides``) give the proxy run its own layout."""
    from megarl.faults.fidelity import write_report

    overrides = list(overrides or [])
    proxy_overrides = list(proxy_overrides or [])
    nprocs = {"original": nproc_per_node, "proxy": proxy_nproc_per_node or nproc_per_node}
    shapes = check_inputs(
        config, original, proxy, steps, overrides, proxy_overrides, (nprocs["original"], nprocs["proxy"])
    )
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    models = {"original": original, "proxy": proxy}
    for name, d in models.items():
        print(
            f"megarl proxy compare: training the {name} ({d}) for {steps} steps; "
            f"log {out_dir / (name + '.log')}",
            flush=True,
        )
    runs = run_trainings(
        {
            n: _train_cmd(
                config,
                d,
                out_dir / n,
                steps,
                overrides + (proxy_overrides if n == "proxy" else []),
                nprocs[n],
            )
            for n, d in models.items()
        },
        {n: out_dir / f"{n}.log" for n in models},
        parallel,
    )
    for name, r in runs.items():
        if r["exit_code"] != 0:
            tail = (out_dir / f"{name}.log").read_text()[-2000:]
            raise RuntimeError(
                f"the {name} run failed (exit {r['exit_code']}); see {out_dir / (name + '.log')}:\n{tail}"
            )
        r.update(
            model=models[name],
            routed_experts=shapes[name]["num_experts"],
            top_k=shapes[name]["num_experts_per_tok"],
            params=_count_params(models[name]),
            nproc_per_node=nprocs[name],
        )
    runs["original"]["params_ratio"] = 1.0
    runs["proxy"]["params_ratio"] = round(runs["proxy"]["params"] / max(runs["original"]["params"], 1), 4)
    rep = write_report(out_dir / "original", out_dir / "proxy", out_dir, extra=runs)
    return rep


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run ``run_compare``; exit 2 on bad input, 1 on a failed run."""
    ap = argparse.ArgumentParser(
        prog="megarl proxy compare",
        description="Train the same recipe on the original model and on a proxy and write "
        "a fidelity report (markdown + PNG) of their curves and fault events.",
    )
    ap.add_argument("--config", required=True, help="the recipe (a megarl train YAML)")
    ap.add_argument("--original", required=True, help="HF checkpoint of the original model")
    ap.add_argument("--proxy", required=True, help="HF checkpoint of the proxy (megarl proxy prune --out)")
    ap.add_argument("--steps", required=True, type=int, help="training steps of each run")
    ap.add_argument("--out", required=True, help="output directory (runs, logs, fidelity.md/png/json)")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for both runs (repeatable), e.g. --set 'faults.dump_on=[nonfinite]'",
    )
    ap.add_argument(
        "--parallel",
        action="store_true",
        help="train both at once (needs spare cores; timings then include the contention)",
    )
    ap.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="run each training under torchrun with this many processes "
        "(the layout: --set parallel.ep=2 ...)",
    )
    ap.add_argument(
        "--proxy-nproc-per-node",
        type=int,
        default=None,
        help="processes of the proxy run (default: --nproc-per-node)",
    )
    ap.add_argument(
        "--proxy-set",
        dest="proxy_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for the proxy run only, after --set (e.g. its own parallel.ep)",
    )
    a = ap.parse_args(argv)
    try:
        rep = run_compare(
            a.config,
            a.original,
            a.proxy,
            a.steps,
            a.out,
            a.overrides,
            a.parallel,
            a.nproc_per_node,
            a.proxy_nproc_per_node,
            a.proxy_overrides,
        )
    except CompareError as e:
        print(f"megarl proxy compare: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"megarl proxy compare: {e}", file=sys.stderr)
        return 1
    for c in rep["curves"]:
        r = c["pearson_r"]
        rho, rx = c["spearman_rho"], c["pearson_r_without_fault_steps"]
        print(
            f"  {c['label']:<46} r={'n/a' if r is None else f'{r:+.3f}'}  "
            f"spearman={'n/a' if rho is None else f'{rho:+.3f}'}  "
            f"r w/o fault steps={'n/a' if rx is None else f'{rx:+.3f}'}  "
            f"mean ratio={c['mean_ratio'] if c['mean_ratio'] is None else round(c['mean_ratio'], 3)}  "
            f"mean|diff|={c['mean_abs_diff']:.4g}"
        )
    ev = rep["events"]
    print(f"  fault events: original {ev['original'] or 'none'}; proxy {ev['proxy'] or 'none'}")
    print(f"  verdict: {rep['verdict']}")
    if rep.get("routing_coverage"):
        cov = rep["routing_coverage"]
        print(
            f"  proxy routing (prune report): routing mass kept {cov.get('routing_mass_covered')}, "
            f"tokens with all experts kept {cov.get('tokens_fully_covered')}"
        )
    ratios = rep["cost"]["ratios"]
    print(
        "  cost, proxy / original: "
        + ", ".join(f"{k} {v:.3g}" for k, v in ratios.items())
        + f" ({rep['cost']['note']})"
    )
    print(f"report: {Path(a.out) / 'fidelity.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
