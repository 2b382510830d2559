"""Start a vLLM or SGLang server (from its own venv, locally or under an ``srun`` prefix) and wait for it.

The server gets a per-job generation key through the environment (``VLLM_API_KEY``, not the
command line). vLLM listens on a Unix socket in a fresh 0700 directory, not on a TCP port: its
control routes (``/pause``, ``/collective_rpc``, ...) take no key, so only this user may reach it.
An authenticating forwarder (``megarl.rollout.auth_proxy``) listens on ``expose_host`` (the node's
job-network address; loopback when unset) and is the only way in: it checks the generation key on
``/v1/*`` and the admin key on the control routes.

A launched server dies with the process that launched it, even a SIGKILLed one: the server gets
``PR_SET_PDEATHSIG`` (SIGTERM) and a watchdog process (``megarl.launch.lifeline``) kills its whole
process group (SIGTERM, then SIGKILL) once the launcher is gone; ``atexit`` covers a normal exit.

SGLang separates a generation key (``--api-key``) from an admin key (``--admin-api-key``) on
every control route itself, so it binds directly to the chosen address; its keys go into a
0600 YAML file passed with ``--config`` (never on the command line).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from megarl.launch.lifeline import kill_group, preexec_die_with_parent, shared_watchdog
from megarl.rollout.keys import RolloutKeys
from megarl.rollout.types import RolloutError


class ServerLaunchError(RolloutError):
    """The server did not become healthy; the message carries the tail of its log."""


def default_vllm_python() -> str:
    """$MEGARL_VLLM_PYTHON, else ``.venv-vllm/bin/python`` at the repository root."""
    env = os.environ.get("MEGARL_VLLM_PYTHON")
    if env:
        return env
    return str(Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file (or a note that it is missing)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"<no log: {e}>"


@dataclass
class VLLMServerConfig:
    """How to start one vLLM server. vLLM itself listens on a Unix socket in a new 0700 directory
    under ``socket_dir`` (default: $TMPDIR); the forwarder on ``expose_host:expose_port`` (default
    loopback, a free port). ``port`` only names the default work dir. ``command_prefix`` runs the
    server (and the forwarder) under e.g. ``["srun", "--overlap", "-N1", "-n1", "-w", NODE]`` (the
    socket directory must then be on the server's node: the same node, or a shared ``socket_dir``)."""

    model_dir: str
    python: str = field(default_factory=default_vllm_python)
    served_model_name: str = "policy"
    port: int = 0
    expose_host: str | None = None
    expose_port: int = 0
    dtype: str = "bfloat16"
    max_model_len: int = 1024
    max_num_seqs: int = 16
    enforce_eager: bool = True
    kv_cache_gib: int = 1
    startup_timeout_s: float = 300.0
    work_dir: str | None = None
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    command_prefix: list[str] = field(default_factory=list)
    socket_dir: str | None = None
    weight_receiver: bool = True  # load megarl's worker extension: weights can be sent in memory


RECEIVER_DIR = Path(__file__).parent / "vllm_ext"


class _ServerProcess:
    """What a launched server has in common: its port, work dir and log, the process (in a session
    of its own), the model's vocabulary, and how it is killed or stopped."""

    kind = "server"

    def __init__(self, cfg, keys: RolloutKeys, host: str = "127.0.0.1"):
        self.cfg, self.keys = cfg, keys
        self.port = cfg.port or free_port(host)
        self.work_dir = Path(cfg.work_dir or Path(cfg.model_dir).parent / f"{self.kind}-{self.port}")
        self.work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log_path = self.work_dir / "server.log"
        self.proc: subprocess.Popen | None = None
        cfg_json = json.loads((Path(cfg.model_dir) / "config.json").read_text())
        self.vocab_size = int(cfg_json["vocab_size"])

    def _client_defaults(self, kw: dict, max_model_len: int) -> dict:
        """Client keyword arguments: the job's keys and the model's limits unless given."""
        kw.setdefault("api_key", self.keys.api_key)
        kw.setdefault("admin_key", self.keys.admin_key)
        kw.setdefault("vocab_size", self.vocab_size)
        kw.setdefault("max_model_len", max_model_len)
        kw.setdefault("reference_weights_dir", self.cfg.model_dir)
        return kw

    def _open_log(self):
        """The server log, opened for appending with mode 0600: servers print their arguments, and
        SGLang's include both API keys."""
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, "ab")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @staticmethod
    def _spawn(cmd: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
        """Start ``cmd`` in a session of its own that dies with this process: SIGTERM from the kernel
        when this process dies (``PR_SET_PDEATHSIG``), and the watchdog kills the whole group."""
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=preexec_die_with_parent(signal.SIGTERM),
            **kw,
        )
        shared_watchdog().watch(proc.pid)
        return proc

    def kill(self) -> None:
        """SIGKILL the server's process group at once (what a crashed node looks like to clients)."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
            shared_watchdog().forget(self.proc.pid)  # gone: its id may be reused by anyone

    @staticmethod
    def _terminate(p: subprocess.Popen | None, timeout_s: float) -> None:
        """SIGTERM ``p``'s process group, SIGKILL after ``timeout_s``; then SIGKILL what is left of
        the group (workers that outlive their leader) after a few seconds."""
        if p is None:
            return
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
            except ProcessLookupError:
                pass
        kill_group(p.pid, grace_s=5.0, term=False)
        shared_watchdog().forget(p.pid)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Terminate the server (SIGTERM to the process group, SIGKILL after ``timeout_s``)."""
        self._terminate(self.proc, timeout_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class VLLMServer(_ServerProcess):
    """A running vLLM server (and its forwarder when exposed). Use ``launch_vllm`` to make one."""

    kind = "vllm"

    def __init__(self, cfg: VLLMServerConfig, keys: RolloutKeys):
        super().__init__(cfg, keys)
        self.proxy_proc: subprocess.Popen | None = None
        self.proxy_url: str | None = None
        self.socket_dir: Path | None = None  # made by start()

    @property
    def uds_path(self) -> Path:
        """vLLM's Unix socket."""
        if self.socket_dir is None:
            raise ServerLaunchError("the vLLM server has not been started (no socket directory yet)")
        return self.socket_dir / "vllm.sock"

    def _make_socket_dir(self) -> None:
        # mkdtemp makes the directory 0700: other users cannot reach the socket (connect needs
        # search permission on the directory), whatever mode vLLM gives the socket file.
        self.socket_dir = Path(tempfile.mkdtemp(prefix="megarl-vllm-", dir=self.cfg.socket_dir))
        if len(os.fsencode(self.uds_path)) > 100:
            raise ServerLaunchError(
                f"Unix socket path {self.uds_path} is too long for the kernel (max ~107 bytes): "
                "set socket_dir (or TMPDIR) to a shorter directory"
            )

    @property
    def url(self) -> str:
        """Where clients connect: the authenticating forwarder (set once started)."""
        if self.proxy_url is None:
            raise ServerLaunchError("the vLLM server has not been started (no forwarder yet)")
        return self.proxy_url

    def command(self) -> list[str]:
        c = self.cfg
        cmd = [
            c.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(c.model_dir),
            "--served-model-name",
            c.served_model_name,
            "--uds",
            str(self.uds_path),
            "--dtype",
            c.dtype,
            "--max-model-len",
            str(c.max_model_len),
            "--max-num-seqs",
            str(c.max_num_seqs),
        ]
        if c.enforce_eager:
            cmd.append("--enforce-eager")
        if c.weight_receiver:
            from megarl.rollout.memory_sync import RECEIVER_CLASS

            cmd += ["--worker-extension-cls", RECEIVER_CLASS]
        return c.command_prefix + cmd + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        cache = self.work_dir / "cache"
        env = dict(os.environ)
        env.update(
            {
                "VLLM_API_KEY": self.keys.api_key,  # the environment, not argv: /proc/PID/cmdline is public
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_RPC_BASE_PATH": str(self.socket_dir),  # its internal IPC sockets: same 0700 dir
                "VLLM_CPU_KVCACHE_SPACE": str(self.cfg.kv_cache_gib),
                "VLLM_CACHE_ROOT": str(cache / "vllm"),
                "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
                "TRITON_CACHE_DIR": str(cache / "triton"),
                "XDG_CACHE_HOME": str(cache),
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.pop("VIRTUAL_ENV", None)
        if self.cfg.weight_receiver:  # the receiver imports only torch: its directory alone, not megarl
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(RECEIVER_DIR), env.get("PYTHONPATH")) if p)
        env.update(self.cfg.extra_env)
        return env

    def start(self) -> VLLMServer:
        """Start the server (and forwarder) and block until /health answers or raise ServerLaunchError."""
        if not Path(self.cfg.python).exists() and not self.cfg.command_prefix:
            raise ServerLaunchError(
                f"vLLM python {self.cfg.python} does not exist: run `bash tests/setup/20-vllm.sh` "
                "or set MEGARL_VLLM_PYTHON"
            )
        self._make_socket_dir()
        with self._open_log() as log:
            self.proc = self._spawn(self.command(), self.environment(), stdout=log, stderr=subprocess.STDOUT)
        atexit.register(self.stop)
        try:
            _wait_healthy(
                self.proc,
                "http://localhost",
                self.log_path,
                self.cfg.startup_timeout_s,
                "vLLM",
                uds=self.uds_path,
            )
            self._start_proxy()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_proxy(self) -> None:
        host = self.cfg.expose_host or "127.0.0.1"
        port = self.cfg.expose_port or free_port(host)
        env = dict(os.environ)
        env.update(self.keys.env())
        cmd = self.cfg.command_prefix + [
            sys.executable,
            "-m",
            "megarl.rollout.auth_proxy",
            "--listen",
            f"{host}:{port}",
            "--upstream-uds",
            str(self.uds_path),
        ]
        self.proxy_proc = self._spawn(cmd, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proxy_proc.stdout], [], [], 1.0)
            if ready:
                line = self.proxy_proc.stdout.readline()
                if line.startswith("READY "):
                    self.proxy_url = line.split()[1]
                    return
                if not line and self.proxy_proc.poll() is not None:
                    break
        raise ServerLaunchError(
            f"auth forwarder on {host}:{port} did not start (exit {self.proxy_proc.poll()})"
        )

    def client(self, **kw):
        """A ``VLLMEngine`` for this server with the job's keys and the model's limits."""
        from megarl.rollout.vllm_client import VLLMEngine

        return VLLMEngine(
            self.url, self.cfg.served_model_name, **self._client_defaults(kw, self.cfg.max_model_len)
        )

    def stop(self, timeout_s: float = 20.0) -> None:
        """Terminate forwarder and server (SIGTERM to the process group, SIGKILL after ``timeout_s``)."""
        self._terminate(self.proxy_proc, timeout_s)
        self._terminate(self.proc, timeout_s)
        if self.proxy_proc is not None and self.proxy_proc.stdout is not None:
            self.proxy_proc.stdout.close()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


def launch_vllm(cfg: VLLMServerConfig, keys: RolloutKeys | None = None) -> VLLMServer:
    """Start a vLLM server with fresh per-job keys (unless given) and wait until it is healthy."""
    return VLLMServer(cfg, keys or RolloutKeys.generate()).start()


def default_sglang_python() -> str:
    """$MEGARL_SGLANG_PYTHON, else ``.venv-sglang/bin/python`` at the repository root."""
    env = os.environ.get("MEGARL_SGLANG_PYTHON")
    if env:
        return env
    return str(Path(__file__).resolve().parents[2] / ".venv-sglang" / "bin" / "python")


@dataclass
class SGLangServerConfig:
    """How to start one SGLang server. ``host`` is 127.0.0.1 when colocated, else the node's
    job-network address.

    ``device="cpu"`` runs SGLang's CPU engine (the venv of tests/setup/40-sglang.sh): it sets
    ``SGLANG_USE_CPU_ENGINE=1`` and adds ``--device cpu --attention-backend torch_native
    --disable-overlap-schedule --tp 1``; ``max_total_tokens`` then bounds the KV cache (on CPU
    ``mem_fraction_static`` would size it from the host's RAM). ``device=None`` leaves the choice to
    SGLang (CUDA). ``weight_version`` is set on the fresh server (``/update_weight_version``) before
    ``launch_sglang`` returns, so samples are labelled with it until the first weight update (SGLang
    has no start-up option for it and labels them "default" otherwise)."""

    model_dir: str
    python: str = field(default_factory=default_sglang_python)
    host: str = "127.0.0.1"
    port: int = 0
    dtype: str = "bfloat16"
    context_length: int = 1024
    mem_fraction_static: float = 0.3
    device: str | None = None
    max_total_tokens: int | None = None
    weight_version: str | None = None
    startup_timeout_s: float = 600.0
    work_dir: str | None = None
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    command_prefix: list[str] = field(default_factory=list)


class SGLangServer(_ServerProcess):
    """A running SGLang server. Use ``launch_sglang`` to make one."""

    kind = "sglang"

    def __init__(self, cfg: SGLangServerConfig, keys: RolloutKeys):
        super().__init__(cfg, keys, host=cfg.host)

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    def _write_key_config(self) -> Path:
        path = self.work_dir / "sglang-keys.yaml"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(
                f"api-key: {json.dumps(self.keys.api_key)}\n"
                f"admin-api-key: {json.dumps(self.keys.admin_key)}\n"
            )
        os.chmod(path, 0o600)
        return path

    def command(self, key_config: Path) -> list[str]:
        c = self.cfg
        return (
            c.command_prefix
            + [
                c.python,
                "-m",
                "sglang.launch_server",
                "--config",
                str(key_config),
                "--model-path",
                str(c.model_dir),
                "--host",
                c.host,
                "--port",
                str(self.port),
                "--dtype",
                c.dtype,
                "--context-length",
                str(c.context_length),
                "--mem-fraction-static",
                str(c.mem_fraction_static),
            ]
            + self._optional_args()
            + list(c.extra_args)
        )

    def _optional_args(self) -> list[str]:
        c = self.cfg
        args: list[str] = []
        if c.device is not None:
            args += ["--device", c.device]
        if c.device == "cpu":
            args += ["--attention-backend", "torch_native", "--disable-overlap-schedule", "--tp", "1"]
        if c.max_total_tokens is not None:
            args += ["--max-total-tokens", str(c.max_total_tokens)]
        return args

    def environment(self) -> dict[str, str]:
        """The server's environment: offline hub, unbuffered output, the CPU engine switch on CPU."""
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        if self.cfg.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        env.pop("VIRTUAL_ENV", None)
        env.update(self.cfg.extra_env)
        return env

    def start(self) -> SGLangServer:
        """Start the server and block until /health answers or raise ServerLaunchError."""
        if not Path(self.cfg.python).exists() and not self.cfg.command_prefix:
            raise ServerLaunchError(
                f"SGLang python {self.cfg.python} does not exist: run `bash tests/setup/40-sglang.sh` "
                "(CPU) or set MEGARL_SGLANG_PYTHON"
            )
        cmd = self.command(self._write_key_config())
        with self._open_log() as log:
            log.write(f"$ {shlex.join(cmd)}\n".encode())
            self.proc = self._spawn(cmd, self.environment(), stdout=log, stderr=subprocess.STDOUT)
        atexit.register(self.stop)
        try:
            _wait_healthy(self.proc, self.url, self.log_path, self.cfg.startup_timeout_s, "SGLang")
            if self.cfg.weight_version is not None:
                self._set_initial_weight_version(self.cfg.weight_version)
        except BaseException:
            self.stop()
            raise
        return self

    def _set_initial_weight_version(self, version: str) -> None:
        headers = {"Authorization": f"Bearer {self.keys.admin_key}"}
        body = {"new_version": version, "abort_all_requests": False}
        resp = httpx.post(self.url + "/update_weight_version", json=body, headers=headers, timeout=60.0)
        if resp.status_code != 200 or not resp.json().get("success"):
            raise ServerLaunchError(
                f"SGLang at {self.url} refused the initial weight version {version!r}: "
                f"HTTP {resp.status_code} {resp.text[:300]}"
            )

    def client(self, **kw):
        """An ``SGLangEngine`` for this server with the job's keys and the model's limits (and the
        configured initial weight version)."""
        from megarl.rollout.sglang_client import SGLangEngine

        if self.cfg.weight_version is not None:
            kw.setdefault("weight_version", self.cfg.weight_version)
        return SGLangEngine(self.url, **self._client_defaults(kw, self.cfg.context_length))

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL after ``timeout_s``."""
        self._terminate(self.proc, timeout_s)


def _wait_healthy(
    proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float, what: str, uds: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    transport = httpx.HTTPTransport(uds=str(uds)) if uds is not None else None
    with httpx.Client(transport=transport, timeout=2.0) as client:
        _poll_healthy(client, proc, url, log_path, timeout_s, deadline, what)


def _poll_healthy(client, proc, url, log_path, timeout_s, deadline, what) -> None:
    while True:
        code = proc.poll()
        if code is not None:
            raise ServerLaunchError(
                f"{what} server exited with code {code} before becoming healthy; "
                f"log {log_path}, last lines:\n{log_tail(log_path)}"
            )
        try:
            if client.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise ServerLaunchError(
                f"{what} server not healthy after {timeout_s:.0f} s; log {log_path}, "
                f"last lines:\n{log_tail(log_path)}"
            )
        time.sleep(0.5)


def launch_sglang(cfg: SGLangServerConfig, keys: RolloutKeys | None = None) -> SGLangServer:
    """Start an SGLang server with fresh per-job keys (unless given) and wait until it is healthy."""
    return SGLangServer(cfg, keys or RolloutKeys.generate()).start()
