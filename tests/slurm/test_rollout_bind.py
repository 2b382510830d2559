"""Rollout servers listen on the node's own address, not on every interface: the launcher fills
``{host}`` with the address its Slurm node name resolves to (``--rollout-bind`` widens it), and the
stand-in server defaults to loopback."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.launch.layout import Layout, LayoutError
from megarl.launch.node_launcher import LaunchOptions, NodeLauncher, node_address
from megarl.launch.processes import terminate_all
from megarl.launch.roles import assign_roles
from megarl.launch.slurm_env import SlurmTask
from megarl.rollout.server_process import free_port

STANDIN = [sys.executable, "-m", "megarl.launch.standin_server", "--host", "{host}", "--port", "{port}"]


def listen_address(port: int, timeout_s: float = 20.0) -> str:
    """The IPv4 address a TCP socket listens on at ``port`` (from /proc/net/tcp), once it does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            f = row.split()
            addr, hexport = f[1].split(":")
            if f[3] == "0A" and int(hexport, 16) == port:
                return socket.inet_ntoa(bytes.fromhex(addr)[::-1])
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on port {port}")


def one_node_launcher(tmp_path: Path, bind: str | None) -> NodeLauncher:
    task = SlurmTask(
        job_id="1",
        nodes=("localhost",),
        node_id=0,
        proc_id=0,
        n_tasks=1,
        hostname="localhost",
        restart_count=0,
        gpus_on_node=None,
    )
    opts = LaunchOptions(
        layout=Layout(learner_nodes=1, rollout_nodes=0, colocate=True),
        run_dir=tmp_path,
        learner_cmd=["true"],
        rollout_cmd=STANDIN,
        rollout_port=free_port(),
        rollout_bind=bind,
        rollout_startup_timeout_s=30,
    )
    return NodeLauncher(task, opts, log=io.StringIO())


@pytest.mark.parametrize("bind, expected", [(None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")])
def test_rollout_servers_bind_to_the_node_address_unless_widened(tmp_path, bind, expected):
    launcher = one_node_launcher(tmp_path, bind)
    try:
        launcher._start_servers(assign_roles(launcher.task.nodes, launcher.layout)[0])
        assert listen_address(launcher.opts.rollout_port) == expected
    finally:
        terminate_all(launcher.servers)


def test_standin_server_defaults_to_loopback():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "megarl.launch.standin_server", "--port", str(port)])
    try:
        assert listen_address(port) == "127.0.0.1"
    finally:
        proc.kill()
        proc.wait()


def test_node_name_that_resolves_to_loopback_is_refused_in_a_multi_node_job():
    assert node_address("localhost", single_node=True) == "127.0.0.1"
    with pytest.raises(LayoutError, match="'localhost' resolves to 127.0.0.1 .*MEGARL_ROLLOUT_BIND"):
        node_address("localhost", single_node=False)
    with pytest.raises(LayoutError, match="cannot resolve .*'no-such-node.invalid'.*MEGARL_ROLLOUT_BIND"):
        node_address("no-such-node.invalid", single_node=False)
