"""The sbatch templates under a real Slurm (Debian slurm-wlm): node1/node2 learner ranks over gloo, node3 a
rollout server, requeue + resume, a rollout node cut off the network, fail-fast config errors, the proxy
template.

The jobs that need no interaction are submitted together (module fixture) and run while the requeue test
drives its own job, so the whole file stays within its CI budget. The learner workload is
megarl.launch.selftest (small and fast to start); the rollout server is megarl.launch.standin_server (a vLLM
server does not start within this budget).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from megarl.launch.selftest_model import reference_digest
from tests.slurm.cluster import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
SELFTEST = f"{PY} -m megarl.launch.selftest"
STANDIN = f"{PY} -m megarl.launch.standin_server --host {{host}} --port {{port}}"
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@dataclass
class Job:
    id: str
    out: Path
    run_dir: Path

    def text(self) -> str:
        return self.out.read_text() if self.out.exists() else ""


def submit(
    cluster: SlurmCluster, template: str, work: Path, name: str, sbatch_args: list[str], env: dict[str, str]
) -> Job:
    """sbatch a template from slurm/ with MEGARL_* variables in the exported environment."""
    out, run_dir = work / f"{name}.out", work / f"{name}-run"
    full_env = {
        "MEGARL_PYTHON": PY,
        "MEGARL_RUN_DIR": str(run_dir),
        "PYTHONPATH": str(REPO),
        "MEGARL_DIST_TIMEOUT": "60",
        **env,
    }
    r = cluster.cmd(
        "sbatch",
        "--parsable",
        f"--output={out}",
        f"--job-name={name}",
        "--time=10",
        "--signal=B:USR1@5",
        *sbatch_args,
        str(REPO / "slurm" / template),
        env=full_env,
        cwd=work,
    )
    return Job(r.stdout.strip().split(";")[0], out, run_dir)


def wait_state(cluster: SlurmCluster, job: Job, states: tuple[str, ...], timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        info = cluster.job_state(job.id)
        if info["JobState"] in states:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(
                f"job {job.id} is {info['JobState']} after {timeout}s, wanted {states}; output:\n{job.text()}"
            )
        time.sleep(0.3)


def wait_text(job: Job, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(pattern, job.text())
        if m:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{pattern!r} not in the output of job {job.id} after {timeout}s:\n{job.text()}"
            )
        time.sleep(0.3)


def wait_restarted(cluster: SlurmCluster, job: Job, started: str, timeout: float) -> None:
    """Wait until the requeued job's next attempt prints ``started``, through Slurm's own requeue
    back-off (the job waits in PENDING/BeginTime 10-20 s here). Forcing ``StartTime=now`` instead
    started the attempt before node1 had finished the previous one: the batch launch failed at once
    (JobState FAILED, ExitCode 1:0, RunTime 0, nothing written), which is what CI saw as a requeued
    job that never printed its restart line. A final state ends the wait with the job's record."""
    deadline = time.monotonic() + timeout
    seen = None
    while started not in job.text():
        info = cluster.job_state(job.id)
        state = tuple(info.get(k) for k in ("JobState", "Reason", "EligibleTime"))
        if state != seen:  # the transitions, for the CI log (shown when the test fails)
            print(f"requeue test: job {job.id} {state}")
            seen = state
        if info["JobState"] in FINAL or time.monotonic() > deadline:
            record = cluster.cmd("scontrol", "show", "job", job.id, check=False).stdout
            nodes = cluster.cmd("sinfo", "-N", "-l", check=False).stdout
            raise AssertionError(
                f"job {job.id} did not start {started!r} ({info['JobState']} after at most {timeout}s)\n"
                f"{record}\n{nodes}\n{job.text()}"
            )
        time.sleep(1)


def need_nodes(cluster: SlurmCluster, n: int) -> None:
    if len(cluster.node_names) < n:
        pytest.skip(f"NEEDS {n} EMULATED NODES, the fixture fell back to one: {cluster.fallback_reason}")


@pytest.fixture(scope="module")
def work() -> Path:
    d = Path(tempfile.mkdtemp(prefix="megarl-slurm-jobs-"))
    os.chmod(d, 0o755)
    yield d
    if not os.environ.get("MEGARL_KEEP_SLURM_STATE"):
        shutil.rmtree(d, ignore_errors=True)


def tiny_train_config(work: Path) -> Path:
    """The quickstart shrunk to a 2-step run whose files stay under ``work``."""
    d = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    d["data"].update(train=str(work / "tiny-train.jsonl"), eval=str(work / "tiny-eval.jsonl"))
    d["data"]["generate"].update(num_train=64, num_eval=8)
    d["warmup"]["sft_steps"] = 2
    d["schedule"].update(steps=2, prompts_per_step=4, eval_every=0, eval_samples=8, eval_k=2)
    d["logging"].update(run_dir=str(work / "tiny-train-run"), plot=False)
    p = work / "tiny-train.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


@pytest.fixture(scope="module")
def jobs(slurm_cluster: SlurmCluster, work: Path) -> dict[str, Job]:
    """Submit the non-interactive jobs at once; tests wait for their own."""
    c, multi = slurm_cluster, len(slurm_cluster.node_names) >= 3
    jobs = {}
    if multi:
        jobs["multi"] = submit(
            c,
            "multi_node.sbatch",
            work,
            "multi",
            ["--nodes=3"],
            {
                "MEGARL_LEARNER_NODES": "2",
                "MEGARL_PROCS_PER_NODE": "2",
                "MEGARL_ROLLOUT_PORT": "18100",
                "MEGARL_ROLLOUT_CMD": STANDIN,
                "MEGARL_LEARNER_CMD": f"{SELFTEST} --steps 3",
            },
        )
        jobs["bad_tp"] = submit(
            c,
            "multi_node.sbatch",
            work,
            "bad_tp",
            ["--nodes=3"],
            {
                "MEGARL_LEARNER_NODES": "2",
                "MEGARL_PROCS_PER_NODE": "2",
                "MEGARL_TP": "4",
                "MEGARL_ROLLOUT_CMD": STANDIN,
                "MEGARL_LEARNER_CMD": "true",
            },
        )
        jobs["bad_nodes"] = submit(
            c,
            "multi_node.sbatch",
            work,
            "bad_nodes",
            ["--nodes=2"],
            {
                "MEGARL_LEARNER_NODES": "2",
                "MEGARL_ROLLOUT_NODES": "1",
                "MEGARL_ROLLOUT_CMD": STANDIN,
                "MEGARL_LEARNER_CMD": "true",
            },
        )
        jobs["no_rollout_cmd"] = submit(
            c,
            "multi_node.sbatch",
            work,
            "no_rollout_cmd",
            ["--nodes=2"],
            {"MEGARL_LEARNER_NODES": "1", "MEGARL_LEARNER_CMD": f"{SELFTEST} --steps 50 --step-sleep 1"},
        )
    jobs["readme"] = submit(
        c,
        "one_node.sbatch",
        work,
        "readme",
        ["--nodes=1"],
        # README's line: only MEGARL_TRAIN_CONFIG; the template finds the repository's .venv python
        {"MEGARL_TRAIN_CONFIG": str(tiny_train_config(work)), "MEGARL_PYTHON": "", "PYTHONPATH": ""}
        | {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"},
    )
    jobs["proxy"] = submit(
        c,
        "proxy_repro.sbatch",
        work,
        "proxy",
        ["--nodes=1"],
        {
            "MEGARL_LEARNER_CMD": "printenv RANK WORLD_SIZE LOCAL_RANK CUBLAS_WORKSPACE_CONFIG NCCL_ALGO "
            "MEGARL_DIST_TIMEOUT_S",
            "MEGARL_DIST_TIMEOUT": "",
        },
    )  # "": the template's default
    return jobs


def test_requeue_resumes_from_checkpoint(slurm_cluster: SlurmCluster, work: Path, jobs):
    """one_node template (learner ranks + rollout server colocated), interrupted twice:
    attempt 0 gets SIGUSR1 in the batch script (what --signal=B:USR1@N sends) -> checkpoint -> exit 99 ->
    requeue; attempt 1 gets an external `scontrol requeue` (SIGTERM to every process) -> checkpoint within
    KillWait; attempt 2 resumes and finishes. The final weights must equal an uninterrupted run's bit for bit.
    """
    c, steps = slurm_cluster, 7
    job = submit(
        c,
        "one_node.sbatch",
        work,
        "requeue",
        ["--nodes=1"],
        {
            "MEGARL_PROCS_PER_NODE": "2",
            "MEGARL_ROLLOUT_PORT": "18200",
            "MEGARL_ROLLOUT_CMD": STANDIN,
            "MEGARL_LEARNER_CMD": f"{SELFTEST} --steps {steps} --step-sleep 1",
        },
    )
    marker = f"megarl: job {job.id} restart "

    def attempt(i: int) -> str:
        return (
            job.text().split(marker + f"{i} ")[1].split(marker)[0] if marker + f"{i} " in job.text() else ""
        )

    def restart(i: int) -> None:
        info = wait_state(c, job, ("PENDING",) + FINAL, timeout=60)
        assert info["JobState"] == "PENDING" and info["Restarts"] == str(i), job.text()
        wait_restarted(c, job, marker + f"{i} ", timeout=240)

    t0 = time.monotonic()
    wait_text(job, r"selftest: step 2 loss", timeout=120)
    print(f"requeue test: step 2 after {time.monotonic() - t0:.1f}s")
    c.cmd("scancel", "--batch", "--signal=USR1", job.id)
    restart(1)
    print(f"requeue test: restart 1 after {time.monotonic() - t0:.1f}s")
    first = attempt(0)
    stop1 = int(re.search(r"stopping after checkpoint of step (\d+) on request", first).group(1))
    assert "megarl: requeueing job" in first and "exit 99 (the batch script requeues)" in first

    wait_text(job, marker + r"1 (?s:.*)selftest: step " + str(stop1 + 1) + " loss", timeout=120)
    print(f"requeue test: attempt 1 stepping after {time.monotonic() - t0:.1f}s")
    c.cmd("scontrol", "requeue", job.id)
    restart(2)
    print(f"requeue test: restart 2 after {time.monotonic() - t0:.1f}s")
    info = wait_state(c, job, FINAL, timeout=240)
    print(f"requeue test: done after {time.monotonic() - t0:.1f}s")
    text = job.text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", text
    second, third = attempt(1), attempt(2)
    assert f"selftest: resumed from step {stop1}" in second and "selftest: step 1 loss" not in second
    assert "DUE TO JOB REQUEUE" in second
    stop2 = int(re.search(r"resuming from checkpoint step (\d+)", third).group(1))
    assert stop1 < stop2 < steps, text
    assert f"selftest: resumed from step {stop2}" in third and f"selftest: step {stop2 + 1} loss" in third
    node = c.node_names[0]
    assert f"rollout server http://{node}:18200 answered host={node}" in third
    digest = re.search(rf"selftest: done steps={steps} final_loss=\S+ digest=(\w+)", third).group(1)
    assert digest == reference_digest(world_size=2, steps=steps)


def test_multi_node_roles_ranks_and_rollout_handover(slurm_cluster: SlurmCluster, jobs):
    """multi_node template on node1..node3: learner ranks 0-3 on node1/node2 over gloo, rollout server on
    node3."""
    need_nodes(slurm_cluster, 3)
    job = jobs["multi"]
    info = wait_state(slurm_cluster, job, FINAL, timeout=150)
    text = job.text()
    assert info["JobState"] == "COMPLETED", text
    for node, role in (("node1", "learner"), ("node2", "learner"), ("node3", "rollout")):
        assert f"[megarl.launch {node}] role={role} " in text
    for rank, local, host in ((0, 0, "node1"), (1, 1, "node1"), (2, 0, "node2"), (3, 1, "node2")):
        assert (
            f"selftest: rank={rank} local_rank={local} world=4 host={host} node={host} master=node1:" in text
        )
    assert "all_reduce ok sum=10 world=4 hosts=node1,node1,node2,node2" in text
    assert "rollout server http://node3:18100 answered host=node3" in text
    assert "selftest: done steps=3" in text
    assert "[megarl.launch node3] learner state 'done': stopping rollout servers" in text
    addresses = (
        job.run_dir / "rendezvous" / f"job-{job.id}" / "attempt-0" / "rollout_addresses.json"
    ).read_text()
    assert '"url": "http://node3:18100"' in addresses
    assert (job.run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000003"


def test_config_errors_fail_fast_on_every_node(slurm_cluster: SlurmCluster, jobs):
    need_nodes(slurm_cluster, 3)
    for name, message in (
        ("bad_tp", "tp=4 must divide procs_per_node=2"),
        ("bad_nodes", "the job step has 2 node(s) but the layout needs 3"),
    ):
        job = jobs[name]
        info = wait_state(slurm_cluster, job, FINAL, timeout=60)
        text = job.text()
        # exit code 2 from the node that failed first; srun --kill-on-bad-exit may SIGTERM the others first
        assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", text
        assert re.search(
            r"\[megarl.launch node\d\] ERROR config check failed: .*" + re.escape(message), text
        ), text
        assert "starting" not in text  # nothing was launched


def test_rollout_node_cut_off_is_named(slurm_cluster: SlurmCluster, work: Path, jobs):
    """node3 (rollout) loses its network mid-run: learner node1's health check names it and fails the job."""
    need_nodes(slurm_cluster, 3)
    c = slurm_cluster
    job = submit(
        c,
        "multi_node.sbatch",
        work,
        "netcut",
        ["--nodes=3"],
        {
            "MEGARL_LEARNER_NODES": "2",
            "MEGARL_ROLLOUT_PORT": "18300",
            "MEGARL_ROLLOUT_CMD": STANDIN,
            "MEGARL_LEARNER_CMD": "sleep 300",
            "MEGARL_HEALTH_INTERVAL": "0.5",
            "MEGARL_HEALTH_TIMEOUT": "1",
            "MEGARL_HEALTH_FAILURES": "2",
        },
    )
    try:
        wait_text(job, r"\[megarl.launch node1\] starting 1 learner rank", timeout=60)
        c.set_link("node3", up=False)
        wait_text(
            job,
            r"\[megarl.launch node1\] ERROR rollout node node3 died: server http://node3:18300 "
            r"stopped answering /health",
            timeout=30,
        )
    finally:
        c.set_link("node3", up=True)
    info = wait_state(c, job, FINAL, timeout=60)
    text = job.text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", text
    assert "requeueing" not in text and "exit 99" not in text


def test_rollout_server_exit_is_named(slurm_cluster: SlurmCluster, work: Path, jobs):
    """The rollout server process on node3 dies (kill -9): node3 reports it, node1 fails the job naming
    node3."""
    need_nodes(slurm_cluster, 3)
    c = slurm_cluster
    job = submit(
        c,
        "multi_node.sbatch",
        work,
        "srvdeath",
        ["--nodes=3"],
        {
            "MEGARL_LEARNER_NODES": "2",
            "MEGARL_ROLLOUT_PORT": "18400",
            "MEGARL_ROLLOUT_CMD": STANDIN,
            "MEGARL_LEARNER_CMD": "sleep 300",
        },
    )
    wait_text(job, r"\[megarl.launch node1\] starting 1 learner rank", timeout=60)
    pids = c.cmd("ip", "netns", "pids", c.netns_of("node3")).stdout.split()
    killed = 0
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"megarl.launch.standin_server" in cmdline and b"18400" in cmdline:
            os.kill(int(pid), 9)
            killed += 1
    assert killed == 1
    info = wait_state(c, job, FINAL, timeout=60)
    text = job.text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", text
    assert (
        "[megarl.launch node3] ERROR rollout node node3 lost its rollout server 0 on node3 (port 18400): "
        "exited with code -9" in text
    )
    assert "[megarl.launch node1] ERROR rollout node node3 died: " in text
    assert "requeueing" not in text


def test_readme_line_runs_the_trainer_with_the_repository_venv(slurm_cluster: SlurmCluster, jobs):
    """one_node.sbatch with MEGARL_TRAIN_CONFIG only, no python on PATH: the template picks the
    checkout's .venv python, runs the learner alone (no MEGARL_ROLLOUT_CMD: embedded engine) to the end."""
    if not (REPO / ".venv" / "bin" / "python").is_file():
        pytest.skip("no .venv in the checkout (make setup makes it)")
    job = jobs["readme"]
    info = wait_state(slurm_cluster, job, FINAL, timeout=240)
    text = job.text()
    assert info["JobState"] == "COMPLETED", text
    assert f"{REPO}/.venv/bin/python -m megarl.cli train" in text and "rollout servers=0" in text
    assert "step    2/2" in text and "learner ranks finished" in text


def test_missing_rollout_command_fails_without_requeue(slurm_cluster: SlurmCluster, jobs):
    """The rollout node's config error names MEGARL_ROLLOUT_CMD; the learner node, stopped by srun,
    reports a failure, not a pre-emption, so the job is not requeued."""
    need_nodes(slurm_cluster, 2)
    job = jobs["no_rollout_cmd"]
    info = wait_state(slurm_cluster, job, FINAL, timeout=60)
    text = job.text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", text
    assert "no rollout server command was given: set MEGARL_ROLLOUT_CMD" in text
    assert "requeueing" not in text and "exit 99" not in text, text


def test_proxy_template_runs_learner_only(slurm_cluster: SlurmCluster, jobs):
    """proxy_repro template with its command replaced (by a printenv): the learner rank gets the
    torch.distributed variables, the template's determinism switches and its 600 s collective timeout."""
    job = jobs["proxy"]
    info = wait_state(slurm_cluster, job, FINAL, timeout=120)
    text = job.text()
    assert info["JobState"] == "COMPLETED", text
    assert "megarl-proxy: job" in text and "rollout servers=0" in text and "waiting for rollout" not in text
    assert "\n0\n1\n0\n:4096:8\nRing\n600.0\n" in text, text


def test_hostlist_matches_scontrol(slurm_cluster: SlurmCluster):
    from megarl.launch.hostlist import expand_hostlist

    for expr in ("node[1-3]", "gpu-a[008-011,020],cpu7", "r[1-2]-ib[0-1]", "x[09-10]"):
        want = slurm_cluster.cmd("scontrol", "show", "hostnames", expr).stdout.split()
        assert expand_hostlist(expr) == want, expr
