"""``python -m megarl.launch [options] [-- LEARNER COMMAND ...]``: the per-node launcher run by srun.

Run it as ``srun --ntasks-per-node=1 --kill-on-bad-exit=1 python -m megarl.launch ...`` inside an sbatch job
(see slurm/). ``--check --nodes N`` prints the node roles and rank layout without Slurm and without starting
anything.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from pathlib import Path

from megarl.launch.layout import Layout, LayoutError, check_layout
from megarl.launch.node_launcher import EXIT_CONFIG, LaunchOptions, NodeLauncher
from megarl.launch.roles import assign_roles, learner_rank_env, master_addr
from megarl.launch.slurm_env import SlurmEnvError, read_slurm_task


def build_parser() -> argparse.ArgumentParser:
    """The launcher's flags; each has an environment-variable default so sbatch templates can set knobs."""

    def e(name: str, default=None):  # an empty variable counts as unset
        return os.environ.get(name) or default

    p = argparse.ArgumentParser(
        prog="python -m megarl.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("node split and parallel layout")
    g.add_argument(
        "--learner-nodes",
        type=int,
        default=int(e("MEGARL_LEARNER_NODES", 0)) or None,
        help="nodes in the learner group (default: all nodes minus --rollout-nodes)",
    )
    g.add_argument("--rollout-nodes", type=int, default=int(e("MEGARL_ROLLOUT_NODES", 0)))
    g.add_argument(
        "--colocate",
        action="store_true",
        default=e("MEGARL_COLOCATE", "0") == "1",
        help="learner ranks and rollout servers on every node",
    )
    g.add_argument(
        "--procs-per-node",
        type=int,
        default=int(e("MEGARL_PROCS_PER_NODE", 0)) or None,
        help="learner ranks per learner node (default: --gpus-per-node, or 1 on CPU)",
    )
    g.add_argument("--gpus-per-node", type=int, default=int(e("MEGARL_GPUS_PER_NODE", 0)))
    for name in ("tp", "pp", "cp", "ep", "etp"):
        g.add_argument(f"--{name}", type=int, default=int(e(f"MEGARL_{name.upper()}", 1)))
    g.add_argument("--servers-per-node", type=int, default=int(e("MEGARL_SERVERS_PER_NODE", 1)))
    g.add_argument("--gpus-per-server", type=int, default=int(e("MEGARL_GPUS_PER_SERVER", 0)))
    r = p.add_argument_group("rollout servers")
    r.add_argument(
        "--rollout-cmd",
        default=e("MEGARL_ROLLOUT_CMD", ""),
        help="server command; placeholders {host} {port} {node} {index} {gpus} {run_dir}",
    )
    r.add_argument(
        "--rollout-port",
        type=int,
        default=int(e("MEGARL_ROLLOUT_PORT", 8000)),
        help="port of server 0 on each node; server s uses port+s",
    )
    r.add_argument(
        "--rollout-bind",
        default=e("MEGARL_ROLLOUT_BIND"),
        help="address {host} names, that the rollout servers listen on (default: this node's address, "
        "its Slurm node name resolved; 0.0.0.0 = every interface)",
    )
    r.add_argument("--rollout-health-path", default=e("MEGARL_ROLLOUT_HEALTH_PATH", "/health"))
    r.add_argument(
        "--rollout-startup-timeout", type=float, default=float(e("MEGARL_ROLLOUT_STARTUP_TIMEOUT", 900))
    )
    r.add_argument("--health-interval", type=float, default=float(e("MEGARL_HEALTH_INTERVAL", 10)))
    r.add_argument(
        "--health-failures",
        type=int,
        default=int(e("MEGARL_HEALTH_FAILURES", 3)),
        help="consecutive failed health checks after which a rollout node counts as dead",
    )
    r.add_argument("--health-timeout", type=float, default=float(e("MEGARL_HEALTH_TIMEOUT", 5)))
    d = p.add_argument_group("learner")
    d.add_argument("--run-dir", default=e("MEGARL_RUN_DIR", "megarl-run"), help="shared directory of the run")
    d.add_argument("--ckpt-dir", default=e("MEGARL_CKPT_DIR"), help="default: RUN_DIR/checkpoints")
    d.add_argument(
        "--train-config",
        default=e("MEGARL_TRAIN_CONFIG"),
        help="config for the default learner command `python -m megarl.cli train CONFIG`",
    )
    d.add_argument(
        "--master-port",
        type=int,
        default=int(e("MEGARL_MASTER_PORT", 0)) or None,
        help="default: 20000 + job id mod 10000",
    )
    d.add_argument(
        "--dist-timeout",
        type=float,
        default=float(e("MEGARL_DIST_TIMEOUT", 1800)),
        help="seconds before a gloo/NCCL collective times out",
    )
    d.add_argument("--backend", choices=("auto", "gloo", "nccl"), default=e("MEGARL_DIST_BACKEND", "auto"))
    d.add_argument(
        "--stop-grace",
        type=float,
        default=float(e("MEGARL_STOP_GRACE", 60)),
        help="seconds the learner gets to checkpoint after SIGUSR1/SIGTERM",
    )
    p.add_argument(
        "--check", action="store_true", help="print the plan and exit (no Slurm needed with --nodes)"
    )
    p.add_argument("--nodes", help="with --check: comma-separated node names instead of the Slurm node list")
    p.add_argument(
        "learner_cmd",
        nargs=argparse.REMAINDER,
        help="-- learner command (placeholders {rank} {local_rank} {node} {ckpt_dir} {resume} {run_dir})",
    )
    return p


def layout_from_args(args: argparse.Namespace, n_nodes: int) -> Layout:
    """Layout from the flags; learner nodes default to all nodes not in the rollout group."""
    learner_nodes = args.learner_nodes or (n_nodes - args.rollout_nodes)
    procs = args.procs_per_node or (args.gpus_per_node or 1)
    colocate = args.colocate and bool(args.rollout_cmd)  # one node without a server command: learner only
    return Layout(
        learner_nodes=learner_nodes,
        rollout_nodes=args.rollout_nodes,
        colocate=colocate,
        procs_per_node=procs,
        gpus_per_node=args.gpus_per_node,
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        ep=args.ep,
        etp=args.etp,
        servers_per_node=args.servers_per_node,
        gpus_per_server=args.gpus_per_server,
    )


def learner_command(args: argparse.Namespace) -> list[str]:
    """The command after ``--``, or ``python -m megarl.cli train CONFIG``."""
    cmd = list(args.learner_cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if cmd:
        return cmd
    if not args.train_config:
        raise LayoutError(
            "no learner command: pass --train-config CONFIG (runs `python -m megarl.cli train "
            "CONFIG`) or a command after --"
        )
    if importlib.util.find_spec("megarl.cli") is None:
        raise LayoutError(
            "megarl.cli is not available in this installation, so the default "
            "learner command cannot run; pass a learner command after --"
        )
    return [sys.executable, "-m", "megarl.cli", "train", args.train_config]


def print_plan(layout: Layout, nodes: list[str]) -> None:
    """The --check output: one line per node, with its global ranks."""
    plans = assign_roles(nodes, layout)
    print(f"layout: {layout.describe()}")
    for p in plans:
        ranks = ""
        if p.runs_learner:
            rs = [
                learner_rank_env(p, i, layout, master_addr(plans), 0)["RANK"]
                for i in range(layout.procs_per_node)
            ]
            ranks = f" ranks {rs[0]}-{rs[-1]}"
        servers = f" {layout.servers_per_node} rollout server(s)" if p.runs_rollout else ""
        print(f"  {p.node}: {p.role.value}{ranks}{servers}")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 on a config error, 99 when stopped for requeue)."""
    args = build_parser().parse_args(argv)
    try:
        if args.check and args.nodes:
            nodes = [n for n in args.nodes.split(",") if n]
            layout = layout_from_args(args, len(nodes))
            check_layout(layout, len(nodes))
            print_plan(layout, nodes)
            return 0
        task = read_slurm_task()
        layout = layout_from_args(args, task.n_nodes)
        if args.check:
            check_layout(layout, task.n_nodes, task.gpus_on_node)
            print_plan(layout, list(task.nodes))
            return 0
        opts = LaunchOptions(
            layout=layout,
            run_dir=Path(args.run_dir).resolve(),
            learner_cmd=learner_command(args),
            rollout_cmd=shlex.split(args.rollout_cmd),
            ckpt_dir=Path(args.ckpt_dir).resolve() if args.ckpt_dir else None,
            master_port=args.master_port,
            dist_timeout_s=args.dist_timeout,
            backend=args.backend,
            rollout_port=args.rollout_port,
            rollout_bind=args.rollout_bind,
            rollout_health_path=args.rollout_health_path,
            rollout_startup_timeout_s=args.rollout_startup_timeout,
            health_interval_s=args.health_interval,
            health_failures=args.health_failures,
            health_timeout_s=args.health_timeout,
            stop_grace_s=args.stop_grace,
        )
    except (LayoutError, SlurmEnvError) as exc:
        print(f"[megarl.launch] ERROR config check failed: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    return NodeLauncher(task, opts).run()


if __name__ == "__main__":
    sys.exit(main())
