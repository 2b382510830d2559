"""Slurm host lists: ``node[1-3,7],gpu-a[001-002]`` <-> ``["node1", "node2", "node3", "node7", ...]``."""

from __future__ import annotations

import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class HostlistError(ValueError):
    """A Slurm host list that cannot be parsed; the message quotes the offending part."""


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested '[' in host list {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in host list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise HostlistError(f"unbalanced '[' in host list {text!r}")
    parts.append(text[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _expand_one(item: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        return [item]
    head, tail = item[: m.start()], item[m.end() :]
    out: list[str] = []
    for rng in m.group(1).split(","):
        r = _RANGE.match(rng.strip())
        if r is None:
            raise HostlistError(f"bad range {rng!r} in host list {whole!r}")
        lo, hi = r.group(1), r.group(2) or r.group(1)
        if int(hi) < int(lo):
            raise HostlistError(f"descending range {rng!r} in host list {whole!r}")
        width = len(lo) if lo.startswith("0") else 0
        for n in range(int(lo), int(hi) + 1):
            for rest in _expand_one(tail, whole):  # a second bracket in the same name: node[1-2]-ib[0-1]
                out.append(f"{head}{n:0{width}d}{rest}")
    return out


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list expression in order, keeping zero padding (``a[08-10]`` -> a08, a09, a10)."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        hosts.extend(_expand_one(item, text))
    if not hosts:
        raise HostlistError(f"empty host list {text!r}")
    return hosts
