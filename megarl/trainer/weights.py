"""Weight sync from the learner to the rollout engine (collective: every rank exports its shards).

The embedded engine takes the HF-named tensors in memory; server engines (vLLM, SGLang) reload an
exported HF checkpoint directory ``weights_dir/vNNNNNN``, or (``rollout.weight_sync: memory``)
receive the tensors over a torch.distributed group. The asynchronous loop brackets a sync
with its producer's pause/abort and resume (megarl/trainer/rollout_producer.py). A step hook that
is a ``RolloutWeights`` (parameter-space exploration) changes the learner's weights around each
sync and restores them after it; ``push_weights`` is what method parts call to push weights of
their own (an evolution-strategies population, a second trainable model) under a label.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megarl.learner.factory import export_state
from megarl.plugin.spec import RolloutWeights


def export_dir(run: Any, version: int | str, learner: Any = None) -> Path:
    """Export the learner (``learner``: another learner of the run's architecture) as a HF
    checkpoint for ``version`` (an int: ``vNNNNNN``; a str: that name) (collective); returns its
    directory."""
    from megarl.convert.hf_megatron import save_hf_checkpoint

    r = run.cfg.rollout
    name = f"v{version:06d}" if isinstance(version, int) else version
    wdir = Path(r.weights_dir or run.run_dir / "weights") / name
    if dist.get_rank() == 0 and wdir.exists():
        shutil.rmtree(wdir)
    dist.barrier()
    save_hf_checkpoint((learner or run.learner).model, run.groups, wdir, hf_config=run.hf)
    return wdir


def weight_sync_mode(rollout: Any) -> str:
    """``rollout.weight_sync`` resolved: "auto" is "memory" for a server the run launches itself
    (a vLLM one has the weight receiver; SGLang receives weights itself), else "disk"."""
    if rollout.weight_sync != "auto":
        return rollout.weight_sync
    return "memory" if rollout.engine in ("vllm", "sglang") and rollout.launch else "disk"


def push_weights(run: Any, version: int | str, learner: Any = None) -> None:
    """The learner's current weights -> ``run.engine`` as ``version`` (collective). ``learner``: a
    second trainable model of the run's architecture that a method builds, served by the same
    engine one at a time (None: the policy)."""
    if run.cfg.rollout.engine == "embedded":
        state = export_state(learner or run.learner)
        if run.engine is not None:
            run.loop.run_until_complete(run.engine.update_weights_from_tensors(state, str(version)))
        return
    if weight_sync_mode(run.cfg.rollout) == "memory":
        from megarl.convert.hf_megatron import hf_tensor_names, iter_hf_buckets
        from megarl.rollout.memory_sync import DEFAULT_BUCKET_BYTES

        model = learner or run.learner
        # collective: every rank gathers bucket by bucket; the engine's rank sends each as it comes
        buckets = iter_hf_buckets(model.model, model.groups, DEFAULT_BUCKET_BYTES)
        try:
            if run.engine is not None:
                names = hf_tensor_names(model.model, model.groups)
                run.loop.run_until_complete(run.engine.update_weights_streamed(names, buckets, str(version)))
        finally:
            for _ in buckets:  # what the send did not take (none, or after a failure): keep ranks in step
                pass
        return
    wdir = export_dir(run, version, learner)
    if run.engine is not None:
        run.loop.run_until_complete(run.engine.update_weights(str(wdir), str(version)))


def sync_weights(run: Any, version: int) -> None:
    """The policy of ``version`` -> ``run.engine`` (collective), inside every ``RolloutWeights``
    hook's ``rollout_weights(version)``."""
    hooks = [h for h in run.method.step_hooks if isinstance(h, RolloutWeights)]
    with contextlib.ExitStack() as stack:
        for h in hooks:
            stack.enter_context(h.rollout_weights(version))
        push_weights(run, version)
