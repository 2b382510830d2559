"""Launcher logic without Slurm: host lists, Slurm env parsing, layout check, role and rank assignment,
checkpoint and rendezvous files, the CLI's --check, and distributed errors naming rank and host."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.launch.checkpoint_dirs import commit_checkpoint, find_latest
from megarl.launch.hostlist import HostlistError, expand_hostlist
from megarl.launch.layout import Layout, LayoutError, check_layout
from megarl.launch.node_launcher import LaunchOptions, NodeLauncher, format_cmd
from megarl.launch.rendezvous import Rendezvous, RendezvousTimeout
from megarl.launch.roles import Role, assign_roles, default_master_port, learner_rank_env, master_addr
from megarl.launch.slurm_env import SlurmEnvError, SlurmTask, read_slurm_task

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- host lists
@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("gpu-a[008-010],cpu7", ["gpu-a008", "gpu-a009", "gpu-a010", "cpu7"]),
        ("n[1,3-4],m[2]", ["n1", "n3", "n4", "m2"]),
        ("r[1-2]-ib[0-1]", ["r1-ib0", "r1-ib1", "r2-ib0", "r2-ib1"]),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    "text, fragment",
    [("node[1-3", "unbalanced"), ("node[3-1]", "descending"), ("node[a-b]", "bad range"), ("", "empty")],
)
def test_expand_hostlist_rejects(text, fragment):
    with pytest.raises(HostlistError, match=fragment):
        expand_hostlist(text)


# ---------------------------------------------------------------- Slurm environment
def test_read_slurm_task():
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_STEP_NODELIST": "node[1-3]",
        "SLURM_NODEID": "2",
        "SLURM_PROCID": "2",
        "SLURM_NTASKS": "3",
        "SLURMD_NODENAME": "node3",
        "SLURM_RESTART_COUNT": "1",
        "SLURM_GPUS_ON_NODE": "8",
    }
    t = read_slurm_task(env)
    assert (t.job_id, t.nodes, t.node_name, t.n_nodes, t.restart_count, t.gpus_on_node) == (
        "42",
        ("node1", "node2", "node3"),
        "node3",
        3,
        1,
        8,
    )
    assert read_slurm_task(dict(env, SLURM_GPUS_ON_NODE="", CUDA_VISIBLE_DEVICES="0,1")).gpus_on_node == 2


@pytest.mark.parametrize(
    "drop, fragment",
    [("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST is not set"), ("SLURM_NODEID", "SLURM_NODEID is not set")],
)
def test_read_slurm_task_missing(drop, fragment):
    env = {"SLURM_STEP_NODELIST": "a,b", "SLURM_NODEID": "1"}
    del env[drop]
    with pytest.raises(SlurmEnvError, match=fragment):
        read_slurm_task(env)


def test_read_slurm_task_nodeid_outside():
    with pytest.raises(SlurmEnvError, match="SLURM_NODEID=5 outside"):
        read_slurm_task({"SLURM_JOB_NODELIST": "a,b", "SLURM_NODEID": "5"})


# ---------------------------------------------------------------- layout check
def test_check_layout_accepts_a_real_layout():
    # 4 learner nodes x 8 GPUs, TP=4 PP=2 -> DP=4, EP=8 over world/pp=16; 2 rollout nodes x 2 servers x 4 GPUs
    layout = Layout(
        learner_nodes=4,
        rollout_nodes=2,
        procs_per_node=8,
        gpus_per_node=8,
        tp=4,
        pp=2,
        ep=8,
        servers_per_node=2,
        gpus_per_server=4,
    )
    check_layout(layout, allocated_nodes=6, visible_gpus=8)
    assert (layout.world_size, layout.dp, layout.n_servers) == (32, 4, 4)


@pytest.mark.parametrize(
    "kwargs, nodes, gpus, fragment",
    [
        (dict(learner_nodes=2, procs_per_node=2, tp=3), 2, None, "not divisible by tp*pp*cp=3"),
        (dict(learner_nodes=2, procs_per_node=4, tp=8), 2, None, "tp=8 must divide procs_per_node=4"),
        (dict(learner_nodes=2, rollout_nodes=1), 2, None, "has 2 node(s) but the layout needs 3"),
        (dict(learner_nodes=1, procs_per_node=8, ep=3), 1, None, "ep*etp=3*1 must divide world_size/pp=8"),
        (dict(learner_nodes=1, procs_per_node=8, gpus_per_node=4), 1, None, "procs_per_node=8 learner ranks"),
        (dict(learner_nodes=1, procs_per_node=8, gpus_per_node=8), 1, 4, "this node sees 4 GPU(s)"),
        (
            dict(learner_nodes=1, rollout_nodes=1, gpus_per_node=8, servers_per_node=3, gpus_per_server=4),
            2,
            None,
            "servers_per_node=3 x gpus_per_server=4 exceeds gpus_per_node=8",
        ),
        (dict(learner_nodes=1, rollout_nodes=1, colocate=True), 2, None, "rollout_nodes must be 0"),
        (dict(learner_nodes=1, tp=0), 1, None, "tp=0 must be >= 1"),
    ],
)
def test_check_layout_rejects(kwargs, nodes, gpus, fragment):
    with pytest.raises(LayoutError) as err:
        check_layout(Layout(**kwargs), allocated_nodes=nodes, visible_gpus=gpus)
    assert fragment in str(err.value)


# ---------------------------------------------------------------- roles and ranks
def test_assign_roles_split():
    layout = Layout(learner_nodes=2, rollout_nodes=1, procs_per_node=2)
    plans = assign_roles(["node1", "node2", "node3"], layout)
    assert [p.role for p in plans] == [Role.LEARNER, Role.LEARNER, Role.ROLLOUT]
    assert master_addr(plans) == "node1"
    env = learner_rank_env(plans[1], 1, layout, "node1", 29000)
    assert {
        k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
    } == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "NODE_RANK": "1",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "29000",
    }
    with pytest.raises(ValueError, match="node3 has role rollout"):
        learner_rank_env(plans[2], 0, layout, "node1", 29000)


def test_assign_roles_colocated_and_errors():
    plans = assign_roles(["a", "b"], Layout(learner_nodes=2, colocate=True, procs_per_node=4))
    assert [(p.role, p.first_rank, p.rollout_index) for p in plans] == [
        (Role.COLOCATED, 0, 0),
        (Role.COLOCATED, 4, 1),
    ]
    with pytest.raises(LayoutError, match="duplicate node names"):
        assign_roles(["a", "a"], Layout(learner_nodes=2))
    with pytest.raises(LayoutError, match="needs 3"):
        assign_roles(["a", "b"], Layout(learner_nodes=2, rollout_nodes=1))


@settings(max_examples=60, deadline=None)
@given(learner=st.integers(1, 6), rollout=st.integers(0, 4), procs=st.integers(1, 8), colocate=st.booleans())
def test_ranks_are_a_permutation_on_learner_nodes(learner, rollout, procs, colocate):
    rollout = 0 if colocate else rollout
    layout = Layout(learner_nodes=learner, rollout_nodes=rollout, procs_per_node=procs, colocate=colocate)
    nodes = [f"n{i}" for i in range(layout.n_nodes)]
    plans = assign_roles(nodes, layout)
    seen = []
    for p in plans:
        if p.runs_learner:
            envs = [learner_rank_env(p, i, layout, "n0", 1) for i in range(procs)]
            seen += [int(e["RANK"]) for e in envs]
            assert {e["WORLD_SIZE"] for e in envs} == {str(learner * procs)}
            assert [int(e["LOCAL_RANK"]) for e in envs] == list(range(procs))
    assert sorted(seen) == list(range(learner * procs))
    assert sum(p.runs_rollout for p in plans) == (learner if colocate else rollout)
    assert [p.node for p in plans if p.role == Role.ROLLOUT] == nodes[learner:]


def test_default_master_port_spreads_jobs():
    assert default_master_port("123") == 20123 and default_master_port("10123") == 20123
    assert 20000 <= default_master_port("987654") < 30000


def test_format_cmd():
    assert format_cmd(["serve", "--port", "{port}"], port=8001, host="h") == ["serve", "--port", "8001"]
    with pytest.raises(LayoutError, match="unknown placeholder 'prot'"):
        format_cmd(["--port={prot}"], port=1)


# ---------------------------------------------------------------- checkpoints and rendezvous
def test_checkpoint_commit_latest_and_prune(tmp_path):
    assert find_latest(tmp_path) is None
    for step in (1, 2, 3):
        commit_checkpoint(tmp_path, step, lambda d, s=step: (d / "state").write_text(str(s)), keep=2)
    step, path = find_latest(tmp_path)
    assert step == 3 and (path / "state").read_text() == "3"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]

    def crash(d: Path) -> None:
        (d / "state").write_text("half")
        raise KeyboardInterrupt  # killed while writing step 4

    with pytest.raises(KeyboardInterrupt):
        commit_checkpoint(tmp_path, 4, crash)
    assert find_latest(tmp_path)[0] == 3


def test_rendezvous_gathers_and_names_missing_nodes(tmp_path):
    rdv = Rendezvous(tmp_path, "7", 0)
    rdv.publish_rollout("node3", ["http://node3:8000", "http://node3:8001"])
    with pytest.raises(RendezvousTimeout, match="from node\\(s\\) node4 after"):
        rdv.gather_rollout(["node3", "node4"], timeout_s=0.3, poll_s=0.05)
    rdv.publish_rollout("node4", ["http://node4:8000"])
    got = rdv.gather_rollout(["node3", "node4"], timeout_s=1)
    assert got["node4"] == ["http://node4:8000"]
    rdv.mark_dead("node4", "server exited with code -9")
    with pytest.raises(RuntimeError, match="node4: server exited with code -9"):
        rdv.gather_rollout(["node3", "node4"], timeout_s=1)
    assert Rendezvous(tmp_path, "7", 1).dir != rdv.dir  # a requeued attempt starts clean


# ---------------------------------------------------------------- CLI
def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MEGARL_"))}
    return subprocess.run(
        [sys.executable, "-m", "megarl.launch", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**base, **(env or {})},
        timeout=60,
    )


def test_cli_check_prints_plan():
    r = _cli("--check", "--nodes", "a,b,c", "--rollout-nodes", "1", "--procs-per-node", "4", "--tp", "2")
    assert r.returncode == 0, r.stderr
    assert "a: learner ranks 0-3" in r.stdout and "b: learner ranks 4-7" in r.stdout
    assert "c: rollout 1 rollout server(s)" in r.stdout and "dp=4" in r.stdout


def test_cli_fails_fast_with_clear_messages():
    r = _cli("--check", "--nodes", "a,b", "--procs-per-node", "2", "--tp", "4")
    assert r.returncode == 2 and "tp=4 must divide procs_per_node=2" in r.stderr
    r = _cli("--", "true")
    assert r.returncode == 2 and "run the launcher inside a Slurm job step" in r.stderr
    slurm = {"SLURM_JOB_NODELIST": "n1", "SLURM_NODEID": "0", "SLURM_NTASKS": "1"}
    r = _cli(env=slurm)
    assert r.returncode == 2 and "no learner command" in r.stderr
    r = _cli("--rollout-nodes", "1", "--", "true", env=slurm)
    assert r.returncode == 2 and "rollout_nodes=1: no node is left for the learner" in r.stdout
    r = _cli("--learner-nodes", "1", "--rollout-nodes", "1", "--", "true", env=slurm)
    assert r.returncode == 2 and "has 1 node(s) but the layout needs 2" in r.stdout


# ---------------------------------------------------------------- distributed errors name rank and host
def test_collective_timeout_names_rank_and_host(tmp_path):
    """Rank 1 never joins the first all_reduce; rank 0 must fail within the configured timeout, naming
    itself."""
    from tests.slurm.cluster import _free_port

    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MEGARL_NODE=f"host{rank}",
            MEGARL_DIST_TIMEOUT_S="4",
            MEGARL_DIST_BACKEND="gloo",
            PYTHONPATH=str(REPO),
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "megarl.launch.selftest",
                    "--hang-rank",
                    "1",
                    "--ckpt-dir",
                    str(tmp_path),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        out, err = procs[0].communicate(timeout=90)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 1, out + err
    assert "selftest: ERROR rank 0/2 (local 0) on host0: all_reduce failed (timeout 4s, backend gloo)" in err


# ---------------------------------------------------------------- launcher decisions without Slurm
def _learner_of_two(tmp_path: Path) -> NodeLauncher:
    task = SlurmTask(
        job_id="1",
        nodes=("a", "b"),
        node_id=0,
        proc_id=0,
        n_tasks=2,
        hostname="a",
        restart_count=0,
        gpus_on_node=None,
    )
    opts = LaunchOptions(
        layout=Layout(learner_nodes=1, rollout_nodes=1),
        run_dir=tmp_path,
        learner_cmd=["true"],
        rollout_startup_timeout_s=20,
    )
    return NodeLauncher(task, opts, log=io.StringIO())


def _run_with_signal_after(launcher: NodeLauncher, delay: float) -> int:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        return launcher.run()
    finally:
        timer.cancel()
        for s, h in saved.items():
            signal.signal(s, h)


def test_stop_while_waiting_for_rollout_requeues_unless_a_peer_failed(tmp_path):
    """Pre-emption before the ranks exist: exit 99 (requeue); the same signal after a peer failed: exit 1."""
    assert _run_with_signal_after(launcher := _learner_of_two(tmp_path / "x"), 0.3) == 99
    assert "nothing to checkpoint yet, exit 99 (the batch script requeues)" in launcher._log_stream.getvalue()
    launcher = _learner_of_two(tmp_path / "y")
    Rendezvous(tmp_path / "y", "1", 0).set_learner_state("failed")
    assert _run_with_signal_after(launcher, 0.3) == 1
    assert "after another learner node failed" in launcher._log_stream.getvalue()


def test_rollout_node_dead_before_publishing_is_named(tmp_path):
    launcher = _learner_of_two(tmp_path)
    Rendezvous(tmp_path, "1", 0).mark_dead(
        "b", "rollout server 0 on b (port 8000) exited with code 1 during start-up"
    )
    assert launcher.run() == 1
    assert (
        "ERROR rollout node(s) died before publishing: b: rollout server 0 on b"
        in launcher._log_stream.getvalue()
    )


def _learner_only(tmp_path: Path, script: str) -> NodeLauncher:
    task = SlurmTask(
        job_id="1",
        nodes=("a",),
        node_id=0,
        proc_id=0,
        n_tasks=1,
        hostname="a",
        restart_count=0,
        gpus_on_node=None,
    )
    opts = LaunchOptions(
        layout=Layout(learner_nodes=1, rollout_nodes=0),
        run_dir=tmp_path,
        learner_cmd=["bash", "-c", script],
        stop_grace_s=10,
    )
    return NodeLauncher(task, opts, log=io.StringIO())


@pytest.mark.parametrize(
    ("rank_exit", "launcher_exit", "message"),
    [
        ("exit 138", 99, "exit codes [138]); exit 99 (the batch script requeues)"),  # megarl train's code
        ("exit 0", 99, "exit codes [0]); exit 99 (the batch script requeues)"),
        ("exit 2", 1, "exited with code 2 (a failure, not a stop: not requeued)"),
    ],
)
def test_exit_code_of_a_rank_after_a_stop_decides_requeue(tmp_path, rank_exit, launcher_exit, message):
    """After SIGUSR1 a rank's 0 or 128+signal is a checkpointed stop (exit 99); any other code (a config
    error during start-up, a crash) is a failure that must not be requeued."""
    launcher = _learner_only(tmp_path, f"trap '{rank_exit}' USR1; echo started; sleep 20 & wait")
    assert _run_with_signal_after(launcher, 1.5) == launcher_exit, launcher._log_stream.getvalue()
    assert message in launcher._log_stream.getvalue()


def test_rollout_role_without_a_command_names_the_variable_and_fails_the_job(tmp_path):
    task = SlurmTask(
        job_id="1",
        nodes=("a", "b"),
        node_id=1,
        proc_id=1,
        n_tasks=2,
        hostname="b",
        restart_count=0,
        gpus_on_node=None,
    )
    opts = LaunchOptions(
        layout=Layout(learner_nodes=1, rollout_nodes=1), run_dir=tmp_path, learner_cmd=["true"]
    )
    launcher = NodeLauncher(task, opts, log=io.StringIO())
    assert launcher.run() == 2
    assert "set MEGARL_ROLLOUT_CMD" in launcher._log_stream.getvalue()
    # srun then stops the learner node with SIGTERM: a failure (exit 1), not a pre-emption (99, requeued)
    learner = _learner_of_two(tmp_path)
    assert _run_with_signal_after(learner, 0.3) == 1
    assert "b: config check failed: this node has the rollout role" in learner._log_stream.getvalue()
