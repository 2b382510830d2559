"""Learner checkpoints with megatron-core dist_checkpointing: model, optimizer, scheduler, RNG, step.

Layout on disk (``ckpt_dir``)::

    <torch_dist shards, common.pt, metadata.json>   dist_checkpointing's format
    megarl.json                                     step, layout it was saved with, HF config,
                                                    optimizer_format, distributed_optimizer

Atomic: all ranks write into ``ckpt_dir + ".tmp-megarl"``, then rank 0 renames it to ``ckpt_dir``;
a crash mid-save leaves no ``ckpt_dir``. The model and the DistributedOptimizer state are saved in
reshardable form (``fully_reshardable``, optimizer keys independent of EP), so a checkpoint loads
under another TP/PP/EP layout; docs/learner.md lists the moves tested. ``load_checkpoint`` refuses
up front an EP change without the distributed optimizer or from a checkpoint of an earlier
optimizer format, and a switch between the distributed and the plain optimizer.
RNG states are stored per global rank and restored when the world size matches (else left alone,
and ``load_checkpoint`` says so in its return value).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict

import torch
import torch.distributed as dist

from megarl.launch.lifeline import forks_die_with_parent
from megarl.learner.learner import Learner

# chained_optim_avoid_prefix: the dense and expert optimizers (EP > 1) save their per-parameter state
# under the same keys as one optimizer (EP = 1) would, so the state loads across EP sizes.
_OPT_META = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
# Checkpoints written before that flag: optimizer state keys carry 'chained_<i>.' when EP > 1.
_OPT_META_PREFIXED = {"distrib_optim_sharding_type": "fully_reshardable"}
OPTIMIZER_FORMAT = 2  # megarl.json 'optimizer_format'; absent in checkpoints with prefixed keys
META_FILE = "megarl.json"
MODEL_ONLY = ["model"]  # megarl.json "contents" of a weights-only checkpoint (megarl convert)


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, incomplete or incompatible; the message names the path."""


def _rng_state() -> dict:
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    st = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict) -> None:
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(st["tracker"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def _ensure_optimizer_state(learner: Learner) -> None:
    """Give a fresh optimizer its state tensors and a 'step' before building a load template.

    megatron-core 0.16.1 without Apex/TE reads one 'step' out of the torch Adam state in
    ``DistributedOptimizer.state_dict()`` (assert len(steps) == 1), but its ``init_state_fn`` creates
    only exp_avg / exp_avg_sq, so loading into a learner that has not stepped yet fails, and so does
    saving one (a learner whose weights moved without an optimizer step: evolution strategies). The
    loaded checkpoint overwrites these values; a state that exists is left as it is.
    """
    for opt in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer]):
        inner = getattr(opt, "optimizer", None)
        init = getattr(opt, "init_state_fn", None)
        if inner is None or init is None:
            continue
        init(inner, opt.config)
        for st in inner.state.values():
            st.setdefault("step", torch.tensor(0.0))


def _split_optimizer_state(state: dict, n_opts: int) -> tuple[list[dict], list]:
    """The loaded optimizer state as (the saved optimizers' common parts, this learner's
    per-optimizer parameter states).

    dist_checkpointing merges the common part as saved (one dict, or ``{0: dense, 1: expert}`` when
    the saving run had EP > 1) with the parameter state in the shape of this learner's template,
    so the two can be nested differently when EP changed.
    """
    chained = [state[k] for k in sorted(k for k in state if isinstance(k, int))]
    saved_chained = any("param_state_sharding_type" in c or "optimizer" in c for c in chained)
    top = {k: v for k, v in state.items() if not isinstance(k, int)}
    commons = chained if saved_chained else [top]
    if n_opts == 1:
        param_states = [state.get("param_state")]
    else:
        param_states = [state.get(i, {}).get("param_state") for i in range(n_opts)]
    commons = [{k: v for k, v in c.items() if k != "param_state"} for c in commons]
    return commons, param_states


def _common_for(opt, commons: list[dict]) -> dict:
    """The common optimizer state (hyper-parameters and step of each parameter group) for ``opt``
    from the saved optimizers' common parts.

    megatron matches parameter groups by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr).
    Experts are expert-parallel groups only when EP > 1, so after an EP change each saved group is
    also offered under the other ``is_expert_parallel`` value (every optimizer of a run steps
    together: hyper-parameters and step agree).
    """
    if any("optimizer" not in c for c in commons):
        return commons[0]
    groups = [g for c in commons for g in c["optimizer"]["param_groups"]]
    flipped = [
        dict(g, is_expert_parallel=not g["is_expert_parallel"]) for g in groups if "is_expert_parallel" in g
    ]
    out = dict(commons[0])
    out["optimizer"] = dict(commons[0]["optimizer"], param_groups=flipped + groups)  # own values win
    return out


def _load_optimizer(learner: Learner, state: dict) -> None:
    """``optimizer.load_state_dict`` with the per-parameter state loaded in a second phase.

    megatron-core 0.16.1 without Apex/TE puts a torch-Adam 'step' into every parameter's state and
    then copies *every* state key from the checkpoint's parameter state, which never holds 'step'
    (KeyError). So: load the common part (this sets the steps), set 'step' aside, load the
    parameter state, put 'step' back (one tensor per parameter).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
    commons, param_states = _split_optimizer_state(state, len(opts))
    for opt, param_state in zip(opts, param_states):
        part = dict(_common_for(opt, commons))
        if not (
            isinstance(opt, DistributedOptimizer)
            and part.get("param_state_sharding_type") == "fully_reshardable"
        ):
            if len(commons) != len(opts):
                raise CheckpointError(
                    f"checkpoint has {len(commons)} optimizer(s), the learner {len(opts)}: an EP change "
                    "is supported with the distributed optimizer only"
                )
            opt.load_state_dict(commons[opts.index(opt)])
            continue
        part.pop("param_state_sharding_type")
        opt.load_state_dict(part)
        steps = {p: st.pop("step") for p, st in opt.optimizer.state.items() if "step" in st}
        opt.load_parameter_state_from_fully_reshardable(param_state)
        for p, step in steps.items():
            # megatron hands every parameter the *same* step tensor, which torch Adam increments in
            # place once per parameter: give each its own.
            opt.optimizer.state[p]["step"] = step.detach().clone()


# megatron-core versions whose ``get_parameter_state_dp_zero`` was read and found to concatenate the
# buckets of a grad buffer *without* the padding between them, while
# ``sharded_param_state_fully_reshardable`` slices that tensor with the *padded* offsets of
# ``buffer.param_index_map``. Every parameter after a padded bucket then gets its neighbour's values
# (megatron logs "param range exceeds unpadded buffer ... data corruption"). Padding between buckets
# happens when a buffer has several buckets: with PP > 1 a tied embedding gets a bucket of its own.
_DP_ZERO_UNPADDED_VERSIONS = ("0.16",)


def _megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        import megatron.core

        return str(getattr(megatron.core, "__version__", "unknown"))


def _has_padding_between_buckets(buffer) -> bool:
    """Whether a megatron grad buffer has padding after a bucket that is not its last."""
    return any(
        end - start != bucket.numel_unpadded
        for (start, end), bucket in zip(buffer.bucket_indices[:-1], buffer.buckets[:-1])
    )


def _repad_world_tensors(opt, state: dict | None) -> dict | None:
    """Put the padding between buckets back into ``get_parameter_state_dp_zero``'s world tensors, so
    that the buffer offsets of ``param_index_map`` address them (in place; returns ``state``)."""
    if state is None:
        return None
    for gbuf_idx, buffer in enumerate(opt.buffers):
        if not _has_padding_between_buckets(buffer):
            continue
        for world in state[gbuf_idx].values():
            for key, t in list(world.items()):
                if not isinstance(t, torch.Tensor) or t.numel() != buffer.numel_unpadded:
                    continue
                padded = t.new_zeros(buffer.numel)
                offset = 0
                for (start, _), bucket in zip(buffer.bucket_indices, buffer.buckets):
                    n = bucket.numel_unpadded
                    padded[start : start + n] = t[offset : offset + n]
                    offset += n
                world[key] = padded
    return state


@contextmanager
def _bucket_padding_fixed(learner: Learner) -> Iterator[None]:
    """Around ``optimizer.sharded_state_dict`` in the ``fully_reshardable`` format: make the
    DistributedOptimizers' gathered state use padded bucket offsets (see
    ``_DP_ZERO_UNPADDED_VERSIONS``). A no-op when no buffer has padding between buckets.
    An unverified megatron-core version with such a buffer is refused rather than risked."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = [
        o
        for o in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
        if isinstance(o, DistributedOptimizer) and any(map(_has_padding_between_buckets, o.buffers))
    ]
    if opts and not _megatron_version().startswith(_DP_ZERO_UNPADDED_VERSIONS):
        raise CheckpointError(
            f"megatron-core {_megatron_version()}: the distributed optimizer's buffers have padding "
            "between buckets (tied embeddings with PP > 1), and its 'fully_reshardable' state layout "
            f"is verified only for megatron-core {_DP_ZERO_UNPADDED_VERSIONS} (it corrupts such "
            "buffers there unless megarl re-pads them); refusing to save or load. Run with "
            "use_distributed_optimizer=False or check this version and add it to "
            "_DP_ZERO_UNPADDED_VERSIONS"
        )
    originals = {}
    for opt in opts:
        original = opt.get_parameter_state_dp_zero
        originals[id(opt)] = original

        def repadded(*args, _opt=opt, _original=original, **kwargs):
            return _repad_world_tensors(_opt, _original(*args, **kwargs))

        opt.get_parameter_state_dp_zero = repadded
    try:
        yield
    finally:
        for opt in opts:
            del opt.get_parameter_state_dp_zero  # the instance attribute; the method shows again


def _check_main_params_match_model(model_sd: dict, opt_sd: dict, device: torch.device) -> None:
    """Refuse to save an optimizer state whose parameter copies disagree with the model weights.

    In the ``fully_reshardable`` format every parameter's optimizer entry holds its main (fp32)
    copy under ``optimizer.state.param.<model key>``; cast to the model's dtype it must equal the
    model's tensor bit for bit. Collective; raises ``CheckpointError`` on every rank, naming this
    rank's first parameters that do not match.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    def where(sh) -> tuple:
        # One key holds many tensors (each layer's slice of the stacked layers): tell them apart by
        # their offset, or for a ShardedTensorFactory by its per-layer build function (which the
        # optimizer's entry shares).
        build_fn = getattr(sh, "build_fn", None)
        return (
            getattr(sh, "global_offset", None),
            getattr(sh, "axis_fragmentations", None),
            None if build_fn is None else id(build_fn),
        )

    model_data = {}
    for sh in nested_values(model_sd):
        if getattr(sh, "key", None) is not None and isinstance(getattr(sh, "data", None), torch.Tensor):
            model_data[(sh.key, *where(sh))] = sh.data
    prefix = "optimizer.state.param."
    bad = []
    for sh in nested_values(opt_sd):
        key = getattr(sh, "key", None)
        if not isinstance(key, str) or not key.startswith(prefix):
            continue
        ref = model_data.get((key[len(prefix) :], *where(sh)))
        if ref is None:
            continue
        if sh.data.shape != ref.shape or not torch.equal(sh.data.to(device=ref.device, dtype=ref.dtype), ref):
            bad.append(key[len(prefix) :])
    total = torch.tensor([len(bad)], dtype=torch.int64, device=device)
    dist.all_reduce(total)  # every rank refuses together (a lone raise would hang its peers)
    if int(total):
        raise CheckpointError(
            f"the optimizer state to be saved holds parameter copies that differ from the model weights "
            f"for {int(total)} parameter(s) over all ranks (on this rank: {bad[:3]}); refusing to save "
            "a corrupt checkpoint"
        )


def _sharded_state(learner: Learner, is_loading: bool, opt_meta: dict | None = None) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if is_loading:
        _ensure_optimizer_state(learner)

    model_sd = learner.model.sharded_state_dict()
    world, rank = dist.get_world_size(), dist.get_rank()
    with _bucket_padding_fixed(learner):
        opt_sd = learner.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=dict(opt_meta or _OPT_META)
        )
    if not is_loading:
        _check_main_params_match_model(model_sd, opt_sd, learner.groups.device)
    return {
        "model": model_sd,
        "optimizer": opt_sd,
        "rng": ShardedObject(
            "megarl_rng_state", None if is_loading else _rng_state(), (world,), (rank,), replica_id=0
        ),
    }


# Slurm pre-emption and requeue signal every process of a job step.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGUSR1, signal.SIGINT})


@contextmanager
def stop_signals_blocked_in_helpers() -> Iterator[None]:
    """Block the stop signals in this thread while megatron's checkpoint writer starts its helpers.

    dist_checkpointing's writer forks one worker per bucket (megatron's own results queue would also
    spawn a ``multiprocessing.Manager`` server; ``_install_writer_results_queue`` replaces it). Those
    processes do not run the trainer's handlers: a SIGUSR1/SIGTERM that Slurm sends to the whole step
    kills them (default action), and the save fails with BrokenPipeError/EOFError. A blocked signal
    mask is inherited through fork and kept across exec, so helpers born inside this block never act
    on these signals.
    This process still gets them: they are delivered to another thread or once the block ends.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _install_writer_results_queue() -> None:
    """Give megatron's checkpoint writer an in-process results queue.

    megatron makes that queue itself on first use (``filesystem_async._get_write_results_queue``): a
    ``multiprocessing`` Manager server, *spawned* (a new interpreter that imports the trainer's
    modules again: ~1-2 CPU s and one more process at the first save, then alive across saves). Its
    producer and consumer are this process whenever a save is synchronous, as every megarl save is
    (``dist_checkpointing.save``): the writer collects its forked bucket writers' results in this
    process and hands them to itself, so a ``queue.Queue`` does the same with no server process.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", "absent") is not None:  # made already, or not used
        return
    filesystem_async._results_queue = queue.Queue()


def save_checkpoint(learner: Learner, ckpt_dir: str | os.PathLike) -> str:
    """Save the learner (collective). Refuses to overwrite an existing ``ckpt_dir``."""
    from megatron.core import dist_checkpointing

    ckpt_dir = os.fspath(ckpt_dir)
    tmp = ckpt_dir + ".tmp-megarl"
    if dist.get_rank() == 0:
        if os.path.exists(ckpt_dir):
            raise CheckpointError(f"{ckpt_dir} exists; refusing to overwrite a checkpoint")
        if os.path.exists(tmp):
            shutil.rmtree(tmp)  # left over from a crashed save
        os.makedirs(tmp)
    dist.barrier()
    if learner.optimizer is not None:  # an optimizer that never stepped (weights moved otherwise, e.g. ES)
        _ensure_optimizer_state(learner)
    state = _sharded_state(learner, is_loading=False)
    state["scheduler"] = learner.scheduler.state_dict()
    state["step"] = learner.step
    # The writer's forked bucket writers ignore the stop signals and die with this process (SIGKILL
    # included: PR_SET_PDEATHSIG); its results queue is in-process (no Manager server).
    with stop_signals_blocked_in_helpers(), forks_die_with_parent():
        _install_writer_results_queue()
        dist_checkpointing.save(state, tmp)
    if dist.get_rank() == 0:
        meta = {
            "step": learner.step,
            "layout": asdict(learner.groups.layout),
            "world_size": dist.get_world_size(),
            "hf_config": learner.hf_config,
            "optimizer_format": OPTIMIZER_FORMAT,
            "distributed_optimizer": learner.cfg.optim.use_distributed_optimizer,
        }
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f, indent=1)
        os.rename(tmp, ckpt_dir)
    dist.barrier()
    return ckpt_dir


def _check_loadable(learner: Learner, meta: dict, ckpt_dir: str) -> dict:
    """Refuse, before reading any tensor, the layout changes that are not supported; returns the
    optimizer metadata the checkpoint was written with.

    Supported (tested, see docs/learner.md): any TP / PP / DP / EP change with the distributed
    optimizer. Refused: an EP change of a MoE model without the distributed optimizer, or from a
    checkpoint written before optimizer_format 2 (its optimizer keys depend on the EP size), and
    loading with the other optimizer kind (distributed vs not) than the one that saved.
    """
    saved_ep = int(meta.get("layout", {}).get("ep", 1))
    ep = learner.groups.layout.ep
    dist_opt = learner.cfg.optim.use_distributed_optimizer
    if meta.get("distributed_optimizer", dist_opt) != dist_opt:
        raise CheckpointError(
            f"{ckpt_dir}: saved with use_distributed_optimizer={meta['distributed_optimizer']}, "
            f"loading with {dist_opt}: not supported"
        )
    ep_change = learner.spec.is_moe and saved_ep != ep
    prefixed = meta.get("optimizer_format", 1) < OPTIMIZER_FORMAT
    if ep_change and prefixed:
        raise CheckpointError(
            f"{ckpt_dir}: saved at ep={saved_ep} by an earlier megarl (optimizer_format 1, whose optimizer "
            f"state keys depend on EP); load it at ep={saved_ep}"
        )
    if ep_change and not dist_opt:
        raise CheckpointError(
            f"{ckpt_dir}: saved at ep={saved_ep}, loading at ep={ep}: an EP change needs the "
            "distributed optimizer (use_distributed_optimizer=True)"
        )
    return _OPT_META_PREFIXED if prefixed else _OPT_META


def _load_model_only(learner: Learner, ckpt_dir: str, meta: dict) -> dict:
    """Load a weights-only checkpoint (``contents: ["model"]``, as ``megarl convert hf-to-megatron``
    writes): the model's weights, then the optimizer's main parameters refreshed from them; optimizer
    moments, scheduler and RNG stay as the fresh learner has them."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": learner.model.sharded_state_dict()}, ckpt_dir)
    learner.model.load_state_dict(loaded["model"], strict=True)
    learner.optimizer.reload_model_params()
    learner.step = int(meta.get("step", 0))
    meta["rng_restored"] = False
    meta["optimizer_restored"] = False
    return meta


def load_checkpoint(learner: Learner, ckpt_dir: str | os.PathLike) -> dict:
    """Load model, optimizer, scheduler, step (and RNG when the world size matches) into ``learner``,
    whatever layout the checkpoint was saved with (collective). A weights-only checkpoint
    (``contents: ["model"]``) loads the weights into a fresh optimizer. Returns the checkpoint's
    metadata plus ``rng_restored`` and ``optimizer_restored``."""
    from megatron.core import dist_checkpointing

    ckpt_dir = os.fspath(ckpt_dir)
    meta_path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{ckpt_dir}: not a complete megarl checkpoint (no {META_FILE})")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("contents") == MODEL_ONLY:
        return _load_model_only(learner, ckpt_dir, meta)
    opt_meta = _check_loadable(learner, meta, ckpt_dir)
    same_world = meta["world_size"] == dist.get_world_size()
    template = _sharded_state(learner, is_loading=True, opt_meta=opt_meta)
    if not same_world:
        template.pop("rng")
    loaded = dist_checkpointing.load(template, ckpt_dir)
    learner.model.load_state_dict(loaded["model"], strict=True)
    _load_optimizer(learner, loaded["optimizer"])
    learner.scheduler.load_state_dict(loaded["scheduler"])
    learner.step = int(loaded["step"])
    if same_world:
        _set_rng_state(loaded["rng"])
    meta["rng_restored"] = same_world
    meta["optimizer_restored"] = True
    return meta
