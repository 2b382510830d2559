"""File rendezvous on the job's shared run directory: rollout nodes publish their server addresses, the
learner gathers them; each side leaves a state file the other watches (learner done/failed, rollout node
dead).

One directory per job attempt (``attempt-<restart count>``), so a requeued job never reads stale addresses.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from megarl.launch.files import atomic_write_json, atomic_write_text


class RendezvousTimeout(TimeoutError):
    """Rollout nodes that did not publish their addresses in time, named in the message."""


class RolloutNodeDied(RuntimeError):
    """A rollout node reported a dead server before publishing; the message names it."""


class Rendezvous:
    """Shared-directory rendezvous of one job attempt."""

    def __init__(self, run_dir: Path, job_id: str, restart_count: int):
        self.dir = Path(run_dir) / "rendezvous" / f"job-{job_id}" / f"attempt-{restart_count}"
        self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def address_file(self) -> Path:
        return self.dir / "rollout_addresses.json"

    def publish_rollout(self, node: str, urls: list[str]) -> None:
        """Called by a rollout node once all its servers answer their health check."""
        atomic_write_json(self.dir / f"rollout-{node}.json", {"node": node, "urls": urls})

    def mark_dead(self, node: str, reason: str) -> None:
        """Called by a rollout node whose server exited."""
        atomic_write_text(self.dir / f"dead-{node}", reason + "\n")

    def dead_nodes(self) -> dict[str, str]:
        """Rollout nodes that reported a dead server, with the reason."""
        return {p.name.removeprefix("dead-"): p.read_text().strip() for p in self.dir.glob("dead-*")}

    def gather_rollout(
        self, nodes: list[str], timeout_s: float, poll_s: float = 0.2, alive: Callable[[], None] | None = None
    ) -> dict[str, list[str]]:
        """Wait until every node in ``nodes`` published; return {node: [url, ...]} in ``nodes`` order.

        alive: called every poll; may raise to abort the wait (e.g. a learner rank died meanwhile).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            dead = {n: r for n, r in self.dead_nodes().items() if n in nodes}
            if dead:
                raise RolloutNodeDied(
                    "rollout node(s) died before publishing: "
                    + "; ".join(f"{n}: {r}" for n, r in dead.items())
                )
            found = {n: self.dir / f"rollout-{n}.json" for n in nodes}
            missing = [n for n, p in found.items() if not p.exists()]
            if not missing:
                return {n: json.loads(p.read_text())["urls"] for n, p in found.items()}
            if time.monotonic() > deadline:
                raise RendezvousTimeout(
                    f"no rollout server addresses from node(s) {', '.join(missing)} after "
                    f"{timeout_s:.0f}s (rendezvous dir {self.dir})"
                )
            if alive is not None:
                alive()
            time.sleep(poll_s)

    def write_address_file(self, addresses: dict[str, list[str]]) -> Path:
        """The file the learner reads: {"servers": [{"node", "url"}, ...]}."""
        servers = [{"node": n, "url": u} for n, urls in addresses.items() for u in urls]
        atomic_write_json(self.address_file, {"servers": servers})
        return self.address_file

    def mark_stopped(self, node: str) -> None:
        """A learner node whose ranks all stopped (checkpointed) after a stop signal."""
        atomic_write_text(self.dir / f"stopped-{node}", "stopped\n")

    def wait_stopped(self, nodes: list[str], timeout_s: float, poll_s: float = 0.2) -> list[str]:
        """Wait until every node in ``nodes`` marked itself stopped; return the ones still missing."""
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [n for n in nodes if not (self.dir / f"stopped-{n}").exists()]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(poll_s)

    def set_learner_state(self, state: str) -> None:
        """'done', 'failed' or 'stopped'; rollout nodes shut down when they see it."""
        atomic_write_text(self.dir / "learner-state", state + "\n")

    def learner_state(self) -> str | None:
        p = self.dir / "learner-state"
        return p.read_text().strip() if p.exists() else None
