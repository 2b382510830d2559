"""``python -m megarl.rollout.serve``: one rollout server in the foreground, for Slurm rollout commands.

vLLM listens on a Unix socket in a 0700 directory (only this user can reach it) and the
authenticating forwarder on ``--host:--port`` (the node's job-network address, what the Slurm
launcher's ``{host}`` is); with ``--host 127.0.0.1`` the forwarder is still used, so clients always
present keys. Server and forwarder die with this process, even when it is SIGKILLed. Keys come
from the environment (``MEGARL_ROLLOUT_API_KEY`` + ``..._ADMIN_KEY``) or a 0600 key file
(``MEGARL_ROLLOUT_KEY_FILE``, e.g. written by ``RolloutKeys.write`` in the job's run directory),
never from the command line. Exits with the server's exit code; SIGTERM/SIGINT
stop server and forwarder.

Example (slurm/ ``MEGARL_ROLLOUT_CMD``):
  python -m megarl.rollout.serve --model /ckpt/step0 --host {host} --port {port}
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from megarl.rollout.keys import RolloutKeys
from megarl.rollout.server_process import (
    ServerLaunchError,
    VLLMServerConfig,
    default_vllm_python,
    launch_vllm,
)


def main(argv: list[str] | None = None) -> int:
    """Start vLLM + forwarder, print ``READY <url>``, wait until the server exits or a signal arrives."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory to serve")
    p.add_argument("--host", required=True, help="address the forwarder listens on (job network)")
    p.add_argument("--port", type=int, required=True, help="port the forwarder listens on")
    p.add_argument("--python", default=default_vllm_python(), help="python of the vLLM venv")
    p.add_argument("--served-model-name", default="policy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--work-dir", default=None, help="logs and caches (default: beside the model)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("vllm_args", nargs="*", help="extra vLLM arguments after --")
    args = p.parse_args(argv)
    try:
        keys = RolloutKeys.from_env()
    except (KeyError, PermissionError, ValueError) as e:
        print(f"megarl.rollout.serve: {e}", file=sys.stderr)
        return 2
    cfg = VLLMServerConfig(
        model_dir=args.model,
        python=args.python,
        served_model_name=args.served_model_name,
        expose_host=args.host,
        expose_port=args.port,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        startup_timeout_s=args.startup_timeout,
        work_dir=args.work_dir,
        extra_args=list(args.vllm_args),
    )
    try:
        server = launch_vllm(cfg, keys)
    except ServerLaunchError as e:
        print(f"megarl.rollout.serve: {e}", file=sys.stderr)
        return 1
    stop = {"sig": None}

    def on_signal(sig, _frame):
        stop["sig"] = sig

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"READY {server.url} (vLLM log: {server.log_path})", flush=True)
    while stop["sig"] is None and server.alive() and server.proxy_proc.poll() is None:
        time.sleep(0.5)
    code = server.proc.poll()
    server.stop()
    if stop["sig"] is not None:
        return 0
    print(
        f"megarl.rollout.serve: server exited (vLLM code {code}, forwarder code {server.proxy_proc.poll()}); "
        f"log {server.log_path}",
        file=sys.stderr,
    )
    return 1 if not code else (code if code > 0 else 128 - code)


if __name__ == "__main__":
    sys.exit(main())
