"""A stand-in trainer for the orphan tests: launches a server with the real ``launch_vllm`` (the
server python given on the command line), prints ``PIDS <json>`` (every process of the server's
process group and the forwarder), then sleeps until the test SIGKILLs it.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def group_members(pgid: int) -> list[int]:
    """Pids whose process group is ``pgid``."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getpgid(int(name)) == pgid:
                    out.append(int(name))
            except ProcessLookupError:
                pass
    return out


def main(model_dir: str, python: str, work_dir: str, timeout_s: float) -> None:
    from megarl.rollout.server_process import VLLMServerConfig, launch_vllm

    cfg = VLLMServerConfig(model_dir=model_dir, python=python, work_dir=work_dir, startup_timeout_s=timeout_s)
    server = launch_vllm(cfg)
    deadline = time.monotonic() + 60
    pids = group_members(server.proc.pid)
    while len(pids) < 2 and time.monotonic() < deadline:  # the server forks its workers after start-up
        time.sleep(0.2)
        pids = group_members(server.proc.pid)
    proxy = getattr(server, "proxy_proc", None)
    if proxy is not None:
        pids.append(proxy.pid)
    print("PIDS " + json.dumps(pids), flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
