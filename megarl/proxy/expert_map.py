"""Expert ids of recorded faults, translated from the original's numbering to a proxy's.

A fault injected into routed expert N (``faults.inject[].expert``) of the original names N in the
original's numbering; a proxy keeps a subset of the experts renumbered ``0..E'-1``, and its prune
report (``proxy_report.json``) holds the map per layer (``new_index``). A replay on the proxy
injects into the same expert, under its new id; a pruned expert cannot be injected, and the error
names the kept expert that stands for its cluster.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from megarl.faults.config import InjectionConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.mlp(?:\.experts)?$")


class ExpertMapError(ValueError):
    """A recorded expert fault whose expert the proxy does not keep, or cannot be placed."""


def map_expert_injections(
    specs: list[InjectionConfig], model_dir: str | Path
) -> tuple[list[InjectionConfig], list[str]]:
    """``specs`` with each ``expert`` translated through ``model_dir/proxy_report.json`` (unchanged
    when the model has no prune report), and one note per translated fault."""
    report_path = Path(model_dir) / "proxy_report.json"
    if not report_path.is_file() or not any(s.expert >= 0 for s in specs):
        return list(specs), []
    report = json.loads(report_path.read_text())
    layers = {int(lr["layer"]): lr for lr in report.get("layers", [])}
    out, notes = [], []
    for s in specs:
        if s.expert < 0:
            out.append(s)
            continue
        m = _LAYER.match(s.target)
        layer = layers.get(int(m.group(1))) if m else None
        if layer is None:
            raise ExpertMapError(
                f"fault in expert {s.expert} of {s.target!r}: {report_path} has no such MoE layer"
            )
        new = layer["new_index"].get(str(s.expert))
        if new is None:
            rep = next((k for k, c in zip(layer["kept"], layer["clusters"]) if s.expert in c), None)
            raise ExpertMapError(
                f"fault in expert {s.expert} of {s.target!r}: the proxy pruned it (its cluster is "
                f"represented by expert {rep}, proxy expert {layer['new_index'].get(str(rep))}; "
                f"{report_path})"
            )
        out.append(dataclasses.replace(s, expert=int(new)))
        notes.append(
            f"fault in expert {s.expert} of {s.target} injected into proxy expert {new} (same weights)"
        )
    return out, notes
