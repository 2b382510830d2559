"""Per-node launcher, run by ``srun --ntasks-per-node=1`` on every node of a job.

Each launcher reads its Slurm task, checks the layout, then by role:
- rollout nodes start the rollout server command(s), wait for their health check, publish the addresses and
  keep the servers alive until the learner finishes (a server that exits is reported by node name);
- learner nodes gather every rollout address, then start ``procs_per_node`` learner ranks with
  torch.distributed variables, the address list and the checkpoint to resume from; learner node 0 also
  health-checks every rollout server while training runs.
SIGUSR1 / SIGTERM (pre-emption, ``--signal``, ``scontrol requeue``) are forwarded as SIGUSR1 to the learner
ranks, which checkpoint and exit; the launcher then exits with EXIT_REQUEUE so the batch script can requeue
the job.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from megarl.launch.checkpoint_dirs import find_latest
from megarl.launch.layout import Layout, LayoutError, check_layout
from megarl.launch.processes import Child, spawn, terminate_all, wait_all
from megarl.launch.rendezvous import Rendezvous, RendezvousTimeout, RolloutNodeDied
from megarl.launch.roles import NodePlan, assign_roles, default_master_port, learner_rank_env, master_addr
from megarl.launch.slurm_env import SlurmTask

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_REQUEUE = 99  # stopped on a signal after the learner checkpointed: the batch script requeues
# what a learner rank may exit with after a stop signal: 0, or 128 + the signal (the shell convention,
# ``megarl train`` exits 138 after SIGUSR1); killed by the signal before its handler was installed is
# also a stop. Any other code is a failure and is not requeued (e.g. a config error during start-up).
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def stopped_cleanly(code: int) -> bool:
    """Whether a learner rank's exit code after a stop signal means "stopped", not "failed"."""
    return (
        code == 0 or code in {128 + int(s) for s in STOP_SIGNALS} or code in {-int(s) for s in STOP_SIGNALS}
    )


@dataclass
class LaunchOptions:
    """Everything the launcher needs besides the Slurm environment (the CLI flags of ``python -m
    megarl.launch``).

    learner_cmd / rollout_cmd: argument lists; ``{placeholders}`` are filled per process (see ``format_cmd``).
    """

    layout: Layout
    run_dir: Path
    learner_cmd: list[str]
    rollout_cmd: list[str] = field(default_factory=list)
    ckpt_dir: Path | None = None
    master_port: int | None = None
    dist_timeout_s: float = 1800.0
    backend: str = "auto"
    rollout_port: int = 8000
    rollout_bind: str | None = None  # None: this node's own address (see node_address)
    rollout_health_path: str = "/health"
    rollout_startup_timeout_s: float = 900.0
    health_interval_s: float = 10.0
    health_failures: int = 3
    health_timeout_s: float = 5.0
    stop_grace_s: float = 60.0

    @property
    def checkpoint_dir(self) -> Path:
        return self.ckpt_dir if self.ckpt_dir is not None else self.run_dir / "checkpoints"


class LaunchFailure(RuntimeError):
    """A rank, server or node failed; the message names it (rank, node, exit code or health error)."""


class StopRequested(RuntimeError):
    """A stop signal arrived before the learner ranks existed (nothing to checkpoint yet)."""


def format_cmd(cmd: list[str], **values: object) -> list[str]:
    """Fill ``{name}`` placeholders in each argument; an unknown placeholder is an error naming it."""
    out = []
    for arg in cmd:
        try:
            out.append(arg.format(**values))
        except (KeyError, IndexError) as exc:
            raise LayoutError(
                f"unknown placeholder {exc} in command argument {arg!r}; "
                f"known: {', '.join('{' + k + '}' for k in values)}"
            ) from None
    return out


def http_ok(url: str, timeout_s: float = 5.0) -> str | None:
    """None when GET ``url`` answers 2xx, else a short reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return None if 200 <= resp.status < 300 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))


def node_address(node: str, single_node: bool) -> str:
    """The address this node's Slurm name resolves to here: the interface other nodes reach it on
    (rollout URLs are ``http://NODE:PORT``), so servers bound to it are not on every interface.
    A name that resolves to loopback (Debian's ``127.0.1.1 HOSTNAME``) serves one-node jobs only."""
    try:
        addr = socket.gethostbyname(node)
    except OSError as exc:
        raise LayoutError(
            f"cannot resolve this node's name {node!r} to bind the rollout servers to ({exc}); "
            "set MEGARL_ROLLOUT_BIND (--rollout-bind) to its job-network address"
        ) from None
    if ipaddress.ip_address(addr).is_loopback and not single_node:
        raise LayoutError(
            f"this node's name {node!r} resolves to {addr} (loopback) here, out of other nodes' reach: "
            "set MEGARL_ROLLOUT_BIND (--rollout-bind) to its job-network address, or 0.0.0.0 for every "
            "interface"
        )
    return addr


class NodeLauncher:
    """Runs one node's share of a job; ``run()`` returns the process exit code."""

    def __init__(self, task: SlurmTask, opts: LaunchOptions, log=None):
        self.task, self.opts = task, opts
        self.layout = opts.layout
        self.node = task.node_name
        self._log_stream = log or sys.stdout
        self.stop_signal: str | None = None
        self._stop_logged = False
        self.servers: list[Child] = []
        self.ranks: list[Child] = []
        self.server_urls: list[str] = []

    def log(self, msg: str) -> None:
        print(f"[megarl.launch {self.node}] {msg}", file=self._log_stream, flush=True)

    # ------------------------------------------------------------------ entry
    def run(self) -> int:
        """Check, start this node's processes, supervise them, tear down; return the exit code."""
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            if self.task.n_tasks != self.task.n_nodes:
                raise LayoutError(
                    f"the launcher must run as one task per node, but the step has "
                    f"{self.task.n_tasks} task(s) on {self.task.n_nodes} node(s): "
                    f"use srun --ntasks-per-node=1"
                )
            check_layout(self.layout, self.task.n_nodes, self.task.gpus_on_node)
            plans = assign_roles(self.task.nodes, self.layout)
        except LayoutError as exc:
            self.log(f"ERROR config check failed: {exc}")
            return EXIT_CONFIG
        plan = plans[self.task.node_id]
        self.log(
            f"role={plan.role.value} job={self.task.job_id} restart={self.task.restart_count} "
            f"host={self.task.hostname} layout: {self.layout.describe()}"
        )
        rdv = Rendezvous(self.opts.run_dir, self.task.job_id, self.task.restart_count)
        try:
            if plan.runs_rollout:
                self._start_servers(plan)
                rdv.publish_rollout(self.node, self.server_urls)
                self.log(f"rollout servers ready: {' '.join(self.server_urls)}")
            if plan.runs_learner:
                return self._run_learner(plan, plans, rdv)
            return self._serve_until_learner_ends(rdv)
        except StopRequested as exc:
            failure = self._peer_failure(rdv)
            if failure:
                self.log(f"ERROR {exc} after {failure}")
                return EXIT_FAILED
            self.log(
                f"{exc}: nothing to checkpoint yet"
                + (f", exit {EXIT_REQUEUE} (the batch script requeues)" if plan.runs_learner else "")
            )
            return EXIT_REQUEUE if plan.runs_learner else EXIT_OK
        except LaunchFailure as exc:
            self.log(f"ERROR {exc}")
            if plan.runs_rollout and not plan.runs_learner:
                rdv.mark_dead(self.node, str(exc))
            if plan.runs_learner:
                rdv.set_learner_state("failed")
            return EXIT_FAILED
        except LayoutError as exc:
            self.log(f"ERROR config check failed: {exc}")
            # tell the other nodes: srun stops them with SIGTERM, which alone would read as a pre-emption
            if plan.runs_rollout and not plan.runs_learner:
                rdv.mark_dead(self.node, f"config check failed: {exc}")
            if plan.runs_learner:
                rdv.set_learner_state("failed")
            return EXIT_CONFIG
        finally:
            terminate_all(self.ranks + self.servers)

    def _on_signal(self, signum: int, _frame) -> None:
        # No printing here: a handler that prints while the main thread prints raises "reentrant call".
        self.stop_signal = self.stop_signal or signal.Signals(signum).name
        for r in self.ranks:
            r.signal(signal.SIGUSR1, group=False)

    def _stopping(self) -> bool:
        """True once a stop signal arrived; logs it the first time."""
        if self.stop_signal and not self._stop_logged:
            self._stop_logged = True
            self.log(f"got {self.stop_signal}: asking learner ranks to checkpoint and stop")
        return self.stop_signal is not None

    # ------------------------------------------------------------------ rollout side
    def _start_servers(self, plan: NodePlan) -> None:
        if not self.opts.rollout_cmd:
            raise LayoutError(
                "this node has the rollout role but no rollout server command was given: set "
                "MEGARL_ROLLOUT_CMD (the sbatch templates) or --rollout-cmd (python -m megarl.launch)"
            )
        L = self.layout
        bind = self.opts.rollout_bind or node_address(self.node, self.task.n_nodes == 1)
        for s in range(L.servers_per_node):
            port = self.opts.rollout_port + s
            gpus = (
                list(range(s * L.gpus_per_server, (s + 1) * L.gpus_per_server)) if L.gpus_per_server else []
            )
            cmd = format_cmd(
                self.opts.rollout_cmd,
                host=bind,
                port=port,
                node=self.node,
                index=plan.rollout_index * L.servers_per_node + s,
                gpus=",".join(map(str, gpus)),
                run_dir=self.opts.run_dir,
            )
            env = dict(os.environ, MEGARL_NODE=self.node)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
            self.log(f"starting rollout server {s} on port {port}: {' '.join(cmd)}")
            self.servers.append(spawn(f"rollout server {s} on {self.node} (port {port})", cmd, env))
            self.server_urls.append(f"http://{self.node}:{port}")
        deadline = time.monotonic() + self.opts.rollout_startup_timeout_s
        pending = dict(zip(self.server_urls, self.servers))
        while pending:
            for url, child in list(pending.items()):
                if child.returncode is not None:
                    raise LaunchFailure(f"{child.label} exited with code {child.returncode} during start-up")
                if http_ok(url + self.opts.rollout_health_path, 2) is None:
                    del pending[url]
            if self._stopping():
                raise StopRequested(f"stopped by {self.stop_signal} while rollout servers were starting")
            if pending and time.monotonic() > deadline:
                raise LaunchFailure(
                    f"rollout server(s) {', '.join(pending)} on {self.node} not healthy after "
                    f"{self.opts.rollout_startup_timeout_s:.0f}s"
                )
            time.sleep(0.2)

    def _check_servers(self) -> None:
        for child in self.servers:
            if child.returncode is not None:
                raise LaunchFailure(
                    f"rollout node {self.node} lost its {child.label}: exited with code {child.returncode}"
                )

    def _serve_until_learner_ends(self, rdv: Rendezvous) -> int:
        while True:
            state = rdv.learner_state()
            if state is not None:
                self.log(f"learner state '{state}': stopping rollout servers")
                return EXIT_OK
            # exit 0: a non-zero code would make srun --kill-on-bad-exit kill the learner
            if self._stopping():
                self.log(f"stopping rollout servers on {self.stop_signal}")
                return EXIT_OK
            self._check_servers()
            time.sleep(0.2)

    # ------------------------------------------------------------------ learner side
    def _rollout_nodes(self, plans: list[NodePlan]) -> list[str]:
        return [p.node for p in plans if p.runs_rollout]

    def _run_learner(self, plan: NodePlan, plans: list[NodePlan], rdv: Rendezvous) -> int:
        rollout_nodes = self._rollout_nodes(plans)
        addresses: dict[str, list[str]] = {}
        if rollout_nodes:
            self.log(f"waiting for rollout servers on {', '.join(rollout_nodes)}")
            try:
                addresses = rdv.gather_rollout(
                    rollout_nodes, self.opts.rollout_startup_timeout_s, alive=self._check_servers_or_stop
                )
            except (RendezvousTimeout, RolloutNodeDied) as exc:
                raise LaunchFailure(str(exc)) from exc
            rdv.write_address_file(addresses)
        urls = [u for n in rollout_nodes for u in addresses[n]]
        latest = find_latest(self.opts.checkpoint_dir)
        if latest:
            self.log(f"resuming from checkpoint step {latest[0]}: {latest[1]}")
        port = self.opts.master_port or default_master_port(self.task.job_id)
        addr = master_addr(plans)
        base_env = dict(os.environ)
        base_env.update(
            {
                "MEGARL_NODE": self.node,
                "MEGARL_RUN_DIR": str(self.opts.run_dir),
                "MEGARL_CHECKPOINT_DIR": str(self.opts.checkpoint_dir),
                "MEGARL_RESUME_FROM": str(latest[1]) if latest else "",
                "MEGARL_RESUME_STEP": str(latest[0]) if latest else "",
                "MEGARL_RESTART_COUNT": str(self.task.restart_count),
                "MEGARL_DIST_TIMEOUT_S": str(self.opts.dist_timeout_s),
                "MEGARL_DIST_BACKEND": self.opts.backend,
                "MEGARL_ROLLOUT_ADDRESSES": ",".join(urls),
                "MEGARL_ROLLOUT_ADDRESS_FILE": str(rdv.address_file) if rollout_nodes else "",
            }
        )
        base_env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # NCCL timeouts raise instead of hanging
        for local in range(self.layout.procs_per_node):
            env = dict(base_env, **learner_rank_env(plan, local, self.layout, addr, port))
            cmd = format_cmd(
                self.opts.learner_cmd,
                run_dir=self.opts.run_dir,
                ckpt_dir=self.opts.checkpoint_dir,
                resume=env["MEGARL_RESUME_FROM"],
                rank=env["RANK"],
                local_rank=local,
                node=self.node,
            )
            label = f"learner rank {env['RANK']} (local {local}) on {self.node}"
            if local == 0:
                self.log(
                    f"starting {self.layout.procs_per_node} learner rank(s) from {env['RANK']} "
                    f"(MASTER_ADDR={addr} MASTER_PORT={port}): {' '.join(cmd)}"
                )
            self.ranks.append(spawn(label, cmd, env))
        if self.stop_signal:  # a signal arrived before the ranks existed
            for r in self.ranks:
                r.signal(signal.SIGUSR1, group=False)
        return self._supervise_learner(plan, addresses, rdv, [p.node for p in plans if p.runs_learner])

    def _check_servers_or_stop(self) -> None:
        # first: the same signal may have killed our servers (Slurm signals every process)
        if self._stopping():
            raise StopRequested(f"stopped by {self.stop_signal} while waiting for rollout servers")
        self._check_servers()

    def _supervise_learner(
        self, plan: NodePlan, addresses: dict[str, list[str]], rdv: Rendezvous, learner_nodes: list[str]
    ) -> int:
        watch_health = plan.node_rank == 0
        failures: dict[str, int] = {}
        next_health = time.monotonic() + self.opts.health_interval_s
        while True:
            if watch_health:  # first: a dead rollout node fails the job even when a signal is also pending
                dead = rdv.dead_nodes()
                if dead:
                    node, reason = next(iter(dead.items()))
                    raise LaunchFailure(f"rollout node {node} died: {reason}")
            codes = [r.returncode for r in self.ranks]
            bad = [(r, c) for r, c in zip(self.ranks, codes) if c not in (None, 0)]
            if bad and not self.stop_signal:
                raise LaunchFailure("; ".join(f"{r.label} exited with code {c}" for r, c in bad))
            if all(c is not None for c in codes):
                break
            if self._stopping():
                if not wait_all(self.ranks, self.opts.stop_grace_s):
                    raise LaunchFailure(
                        f"learner ranks did not stop within {self.opts.stop_grace_s:.0f}s of "
                        f"{self.stop_signal}"
                    )
                continue
            self._check_servers()
            if watch_health:
                if time.monotonic() >= next_health:
                    self._health_round(addresses, failures)
                    next_health = time.monotonic() + self.opts.health_interval_s
            time.sleep(0.2)
        codes = [r.returncode for r in self.ranks]
        peer_failure = self._peer_failure(rdv)
        # srun --kill-on-bad-exit stopped us: a failure, not a pre-emption
        if self.stop_signal and peer_failure:
            raise LaunchFailure(f"stopped by {self.stop_signal} after {peer_failure}")
        failed = [(r, c) for r, c in zip(self.ranks, codes) if not stopped_cleanly(c)]
        if self.stop_signal and failed:
            raise LaunchFailure(
                f"after {self.stop_signal}: "
                + "; ".join(f"{r.label} exited with code {c}" for r, c in failed)
                + " (a failure, not a stop: not requeued)"
            )
        if self.stop_signal:
            state, rc = "stopped", EXIT_REQUEUE
            # Exit 99 is a "bad exit" for srun --kill-on-bad-exit: wait until every learner node has stopped,
            # so no rank is killed while it still writes its part of the checkpoint.
            rdv.mark_stopped(self.node)
            missing = rdv.wait_stopped(learner_nodes, self.opts.stop_grace_s)
            if missing:
                self.log(
                    f"learner node(s) {', '.join(missing)} did not report stopped within "
                    f"{self.opts.stop_grace_s:.0f}s"
                )
            self.log(
                f"learner ranks stopped after {self.stop_signal} (exit codes {codes}); "
                f"exit {rc} (the batch script requeues)"
            )
        elif any(codes):
            state, rc = "failed", EXIT_FAILED
        else:
            state, rc = "done", EXIT_OK
            self.log("learner ranks finished")
        if plan.node_rank == 0:
            rdv.set_learner_state(state)
        return rc

    def _peer_failure(self, rdv: Rendezvous) -> str | None:
        """What another node reported: a dead rollout node or a failed learner node (None when nothing)."""
        dead = rdv.dead_nodes()
        if dead:
            node, reason = next(iter(dead.items()))
            return f"rollout node {node} died: {reason}"
        if rdv.learner_state() == "failed":
            return "another learner node failed"
        return None

    def _health_round(self, addresses: dict[str, list[str]], failures: dict[str, int]) -> None:
        for node, urls in addresses.items():
            for url in urls:
                reason = http_ok(url + self.opts.rollout_health_path, self.opts.health_timeout_s)
                if reason is None:
                    failures.pop(url, None)
                    continue
                failures[url] = failures.get(url, 0) + 1
                self.log(
                    f"rollout server {url} on {node} failed health check "
                    f"{failures[url]}/{self.opts.health_failures}: {reason}"
                )
                if failures[url] >= self.opts.health_failures:
                    raise LaunchFailure(
                        f"rollout node {node} died: server {url} stopped answering "
                        f"{self.opts.rollout_health_path} ({reason})"
                    )
