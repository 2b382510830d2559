"""A real Slurm cluster on one machine for the tests: munged + slurmctld + one slurmd per emulated node.

Each emulated node is a network + UTS namespace (own hostname ``nodeN``, own IP on a private bridge) with
its own slurmd. Names, subnet and ports are chosen per session so two test sessions on one machine do not
collide. When namespaces cannot be made (not root, no CAP_NET_ADMIN), the cluster falls back to a single
node on loopback and says so in ``fallback_reason``.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SLURM_BINARIES = (
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "squeue",
    "scancel",
    "sinfo",
    "munged",
    "mungekey",
)
NETNS_BINARIES = ("ip", "nsenter", "unshare", "mount")


def missing_binaries(names: tuple[str, ...]) -> list[str]:
    """Names from ``names`` that are not on PATH (sbin included)."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [n for n in names if shutil.which(n, path=path) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kw)


def _used_subnets() -> set[str]:
    out = _run(["ip", "-4", "route"], check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line and line[0].isdigit()}


@dataclass
class SlurmCluster:
    """Handle on a running test cluster. ``env`` is what client commands (sbatch, squeue, ...) need."""

    state_dir: Path
    n_nodes: int = 3
    # more than the machine has (config_overrides): jobs share nodes instead of queueing
    cpus_per_node: int = 8
    node_names: list[str] = field(default_factory=list)
    node_addrs: dict[str, str] = field(default_factory=dict)
    fallback_reason: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    _procs: list[subprocess.Popen] = field(default_factory=list)
    _netns: list[str] = field(default_factory=list)
    _links: list[str] = field(default_factory=list)
    _tag: str = ""

    # ---------------------------------------------------------------- start-up
    def start(self) -> SlurmCluster:
        """Start munged, slurmctld and the slurmds; return when every node is idle."""
        self._tag = f"{random.randrange(16**4):04x}"
        for sub in ("etc", "state", "log", "run", "munge", "spool"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o755)  # munged insists every directory above its socket is o+x
        os.chmod(self.state_dir / "munge", 0o755)
        self.env = dict(os.environ, SLURM_CONF=str(self.state_dir / "etc" / "slurm.conf"))
        self.env["PATH"] = self.env.get("PATH", "") + ":/usr/sbin:/sbin"
        self._start_munge()
        try:
            if os.environ.get("MEGARL_SLURM_SINGLE_NODE"):  # to exercise the fallback on purpose
                raise PermissionError("MEGARL_SLURM_SINGLE_NODE is set")
            self._make_namespaces()
        except (subprocess.CalledProcessError, PermissionError, OSError) as exc:
            err = getattr(exc, "stderr", "") or str(exc)
            self.fallback_reason = f"network namespaces unavailable ({err.strip()}); single node on loopback"
            self._remove_namespaces()
            self.n_nodes = 1
            self._single_node()
        self._write_conf()
        self._spawn(["slurmctld", "-D", "-i"], "slurmctld")
        for name in self.node_names:
            (self.state_dir / "spool" / name).mkdir(exist_ok=True)
            if self._netns:
                ns = self._netns[self.node_names.index(name)]
                inner = (
                    f"mount --bind {self.state_dir}/etc/hosts /etc/hosts && hostname {name} "
                    f"&& exec slurmd -D -N {name}"
                )
                cmd = [
                    "nsenter",
                    f"--net=/run/netns/{ns}",
                    "--",
                    "unshare",
                    "--uts",
                    "--mount",
                    "--propagation",
                    "private",
                    "--",
                    "bash",
                    "-c",
                    inner,
                ]
            else:
                cmd = ["slurmd", "-D", "-N", name]
            self._spawn(cmd, f"slurmd-{name}")
        self._wait_idle(timeout=30)
        return self

    def _spawn(self, cmd: list[str], name: str) -> None:
        log = open(self.state_dir / "log" / f"{name}.out", "w")
        self._procs.append(
            subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )

    def _start_munge(self) -> None:
        m = self.state_dir / "munge"
        _run(["mungekey", "--create", f"--keyfile={m}/munge.key"])
        self._spawn(
            [
                "munged",
                "--foreground",
                f"--socket={m}/munge.sock",
                f"--key-file={m}/munge.key",
                f"--log-file={self.state_dir}/log/munged.log",
                f"--pid-file={self.state_dir}/run/munged.pid",
                f"--seed-file={m}/munged.seed",
            ],
            "munged",
        )
        deadline = time.monotonic() + 10
        while not (m / "munge.sock").exists():
            if time.monotonic() > deadline or self._procs[-1].poll() is not None:
                raise RuntimeError(f"munged did not start; see {self.state_dir}/log/munged.out")
            time.sleep(0.05)

    def _make_namespaces(self) -> None:
        if os.geteuid() != 0:
            raise PermissionError("not root")
        used = _used_subnets()
        free = [f"10.{a}.{b}.0/24" for a in range(200, 250) for b in range(0, 256)]
        random.shuffle(free)
        subnet = next(s for s in free if s not in used)
        prefix = subnet.rsplit(".", 1)[0]
        self.ctl_addr = f"{prefix}.1"
        bridge = f"mrb{self._tag}"
        _run(["ip", "link", "add", bridge, "type", "bridge"])
        self._links.append(bridge)
        _run(["ip", "addr", "add", f"{self.ctl_addr}/24", "dev", bridge])
        _run(["ip", "link", "set", bridge, "up"])
        for i in range(1, self.n_nodes + 1):
            name, ns = f"node{i}", f"mr{self._tag}_node{i}"
            host_end, ns_end = f"mr{self._tag}v{i}h", f"mr{self._tag}v{i}n"
            _run(["ip", "netns", "add", ns])
            self._netns.append(ns)
            _run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end])
            self._links.append(host_end)
            _run(["ip", "link", "set", ns_end, "netns", ns])
            _run(["ip", "link", "set", host_end, "master", bridge])
            _run(["ip", "link", "set", host_end, "up"])
            addr = f"{prefix}.{10 + i}"
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ns_end])
            _run(["ip", "-n", ns, "link", "set", ns_end, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            self.node_names.append(name)
            self.node_addrs[name] = addr
        hosts = ["127.0.0.1 localhost", f"{self.ctl_addr} ctl"]
        hosts += [f"{a} {n}" for n, a in self.node_addrs.items()]
        (self.state_dir / "etc" / "hosts").write_text("\n".join(hosts) + "\n")

    def _single_node(self) -> None:
        self.ctl_addr = "127.0.0.1"
        name = socket.gethostname()
        self.node_names = [name]
        self.node_addrs = {name: "127.0.0.1"}

    def _write_conf(self) -> None:
        s = self.state_dir
        (s / "etc" / "plugstack.conf").write_text("")
        ctld_port = _free_port()
        lines = [
            "ClusterName=megarltest",
            f"SlurmctldHost=localhost({self.ctl_addr})",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={s}/munge/munge.sock,cred_expire=10",
            f"StateSaveLocation={s}/state",
            f"SlurmdSpoolDir={s}/spool/%n",
            f"SlurmctldPidFile={s}/run/slurmctld.pid",
            f"SlurmdPidFile={s}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={s}/log/slurmctld.log",
            f"SlurmdLogFile={s}/log/slurmd-%n.log",
            f"PlugStackConfig={s}/etc/plugstack.conf",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "ReturnToService=2",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MailProg=/bin/true",
            "SlurmdTimeout=30",
            "KillWait=5",
            "MinJobAge=300",
            "SlurmdParameters=config_overrides",  # trust CPUs= below, not the 2 cores slurmd detects
        ]
        if self._netns:
            lines.append(f"SlurmdPort={_free_port()}")
        else:  # loopback: the slurmd port must be free in the one shared network namespace
            lines.append(f"SlurmdPort={_free_port()}")
        for name in self.node_names:
            lines.append(
                f"NodeName={name} NodeAddr={self.node_addrs[name]} CPUs={self.cpus_per_node} "
                "RealMemory=4000 State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=debug Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP"
        )
        (s / "etc" / "slurm.conf").write_text("\n".join(lines) + "\n")

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        want = f"idle {len(self.node_names)}"
        last = ""
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"a Slurm daemon exited during start-up ({p.args[0]} rc={p.returncode}); "
                        f"logs in {self.state_dir}/log"
                    )
            r = _run(["sinfo", "-h", "-o", "%T %D"], check=False, env=self.env)
            last = r.stdout.strip() + r.stderr.strip()
            if last == want:
                return
            time.sleep(0.1)
        raise RuntimeError(f"nodes not idle after {timeout}s (sinfo: {last!r}); logs in {self.state_dir}/log")

    # ---------------------------------------------------------------- client helpers
    def cmd(
        self,
        *args: str,
        check: bool = True,
        timeout: float = 30,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster (``env`` adds variables, e.g. for sbatch)."""
        return _run(list(args), check=check, env={**self.env, **(env or {})}, timeout=timeout, cwd=cwd)

    def netns_of(self, node: str) -> str | None:
        """Network namespace of an emulated node (None in the single-node fallback)."""
        return self._netns[self.node_names.index(node)] if self._netns else None

    def set_link(self, node: str, up: bool) -> None:
        """Cut (or restore) an emulated node's network: its veth inside the namespace goes down (up)."""
        ns = self.netns_of(node)
        if ns is None:
            raise RuntimeError("no network namespaces in the single-node fallback")
        i = self.node_names.index(node) + 1
        _run(["ip", "-n", ns, "link", "set", f"mr{self._tag}v{i}n", "up" if up else "down"])

    def job_state(self, job_id: str) -> dict[str, str]:
        """Fields of ``scontrol show job`` as a dict (JobState, Restarts, NodeList, ExitCode, ...)."""
        out = self.cmd("scontrol", "-o", "show", "job", job_id).stdout
        fields = {}
        for tok in out.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                fields.setdefault(k, v)
        return fields

    # ---------------------------------------------------------------- teardown
    def stop(self) -> None:
        """Cancel jobs, stop the daemons, kill anything left in the namespaces, remove namespaces and
        links."""
        if self.env.get("SLURM_CONF") and Path(self.env["SLURM_CONF"]).exists():
            _run(["scancel", "--full", "--partition=debug"], check=False, env=self.env)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                r = _run(["squeue", "-h"], check=False, env=self.env)
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.2)
        for p in reversed(self._procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self._procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for ns in self._netns:  # stray slurmstepd or job processes
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        self._remove_namespaces()

    def _remove_namespaces(self) -> None:
        for ns in self._netns:
            _run(["ip", "netns", "del", ns], check=False)
        for link in reversed(self._links):
            _run(["ip", "link", "del", link], check=False)
        self._netns, self._links = [], []
        netns_dir = Path("/run/netns")
        if netns_dir.is_dir() and not any(netns_dir.iterdir()):
            _run(["umount", str(netns_dir)], check=False)
            try:
                netns_dir.rmdir()
            except OSError:
                pass
