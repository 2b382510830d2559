"""Weight sync from the learner to the rollout engine (collective: every rank exports its shards).

The embedded engine takes the HF-named tensors in memory; server engines (vLLM, SGLang) reload an
exported HF checkpoint directory ``weights_dir/vNNNNNN``. The asynchronous loop brackets a sync
with its producer's pause/abort and resume (megarl/trainer/rollout_producer.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megarl.learner.factory import export_state


def export_dir(run: Any, version: int) -> Path:
    """Export the learner as a HF checkpoint for ``version`` (collective); returns its directory."""
    from megarl.convert.hf_megatron import save_hf_checkpoint

    r = run.cfg.rollout
    wdir = Path(r.weights_dir or run.run_dir / "weights") / f"v{version:06d}"
    if dist.get_rank() == 0 and wdir.exists():
        shutil.rmtree(wdir)
    dist.barrier()
    save_hf_checkpoint(run.learner.model, run.groups, wdir, hf_config=run.hf)
    return wdir


def sync_weights(run: Any, version: int) -> None:
    """The learner's weights -> ``run.engine`` as ``version`` (collective)."""
    if run.cfg.rollout.engine == "embedded":
        state = export_state(run.learner)
        if run.engine is not None:
            run.loop.run_until_complete(run.engine.update_weights_from_tensors(state, str(version)))
        return
    wdir = export_dir(run, version)
    if run.engine is not None:
        run.loop.run_until_complete(run.engine.update_weights(str(wdir), str(version)))
