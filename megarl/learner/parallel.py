"""Parallel layout (TP, PP, EP, SP, CP; DP from the remaining ranks) and its process groups.

megatron-core keeps its groups in ``parallel_state`` globals, and parts of it (schedules, DDP,
optimizer) read them from there. megarl code never does: ``initialize_parallel`` returns the groups
in a ``ParallelGroups`` value that is passed explicitly to the model, the logprob pass, the step and
the converters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    """How the world is split. ``dp`` is derived: world_size / (tp * pp * cp)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    expert_tp: int | None = None  # tensor parallelism inside experts; None = tp (megatron's default)

    @property
    def etp(self) -> int:
        """Expert tensor-parallel size."""
        return self.tp if self.expert_tp is None else self.expert_tp

    def data_parallel_size(self, world_size: int) -> int:
        """DP size for ``world_size`` ranks; raises if the layout does not divide the world."""
        mp = self.tp * self.pp * self.cp
        if world_size % mp:
            raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp={mp} ({self})")
        dp = world_size // mp
        if (dp * self.cp * self.tp) % (self.ep * self.etp):
            raise ValueError(
                f"ep*expert_tp={self.ep * self.etp} must divide dp*cp*tp={dp * self.cp * self.tp} ({self})"
            )
        if self.ep == 1 and self.etp != self.tp:
            # megatron-core 0.16 marks experts as dense params when ep == 1, so their gradients
            # would only be reduced over DP, not over the TP ranks that saw other tokens.
            raise ValueError(f"expert_tp={self.etp} != tp={self.tp} needs ep > 1 ({self})")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")
        return dp


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups of one layout, and this rank's coordinates in them."""

    layout: ParallelLayout
    world_size: int
    rank: int
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    ep: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup  # data parallel (without CP)
    dp_cp: dist.ProcessGroup  # data + context parallel: dense-parameter gradient reduction
    expt_dp: dist.ProcessGroup  # expert data parallel: expert-parameter gradient reduction
    expt_tp: dist.ProcessGroup  # tensor parallel inside experts
    mp: dist.ProcessGroup  # tensor + pipeline (model parallel)
    pg_collection: object  # megatron's ProcessGroupCollection, for megatron-core constructors
    device: torch.device

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.tp)

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.pp)

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep)

    @property
    def etp_rank(self) -> int:
        return dist.get_rank(self.expt_tp)

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp)

    @property
    def dp_size(self) -> int:
        return dist.get_world_size(self.dp)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1


def use_cuda() -> bool:
    """Whether the learner runs on CUDA (a device is present and MEGARL_FORCE_CPU is unset)."""
    return torch.cuda.is_available() and os.environ.get("MEGARL_FORCE_CPU", "0") != "1"


def init_distributed(timeout_s: float = 120.0) -> None:
    """Start the default process group from torchrun's environment (gloo on CPU, nccl on CUDA);
    outside torchrun, a world of one process."""
    if dist.is_initialized():
        return
    backend = "nccl" if use_cuda() else "gloo"
    if use_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ:
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        return
    # A single process outside torchrun: its own store on a free port, passed explicitly rather than
    # through RANK/MASTER_PORT in os.environ, which every child process (a rollout server, a
    # checkpoint helper, a nested megarl run) would inherit and then fail to rendezvous on.
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=timeout_s),
    )


# megatron keeps its groups in parallel_state's module globals, and a process group cannot be freed
# while any model built on it lives (a learner kept in a test's frame, a reference model held by a
# method). Re-creating the groups on every layout switch therefore piled up gloo threads (~50 per
# switch and rank; 2,000+ in the learner tests). Instead each layout's groups are created once per
# process and megatron's globals are restored from this cache when the layout comes back.
_GROUPS_BY_LAYOUT: dict[tuple, dict] = {}


def _megatron_state() -> dict:
    """A copy of megatron parallel_state's module globals (groups, ranks, cached sizes)."""
    from megatron.core import parallel_state as ps

    return {name: value for name, value in vars(ps).items() if name.startswith("_") and name.isupper()}


def initialize_parallel(layout: ParallelLayout, seed: int = 1234) -> ParallelGroups:
    """Make ``layout`` the active one: its groups over the default process group (created the first
    time this process uses the layout, restored from the per-layout cache after that), megatron's
    RNG tracker seeded; returns the groups.

    On CPU this first applies the megatron-core CPU shims (megarl.learner.cpu_shims).
    """
    from megarl.learner.megatron_import import import_megatron

    import_megatron()  # first, so that megatron-core is imported without torch's compiler stack
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not use_cuda():
        from megarl.learner.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
    init_distributed()
    world = dist.get_world_size()
    layout.data_parallel_size(world)  # validates
    key = (world, layout.tp, layout.pp, layout.cp, layout.ep, layout.etp)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()  # forgets megatron's globals; the groups stay in the cache
    if key in _GROUPS_BY_LAYOUT:
        for name, value in _GROUPS_BY_LAYOUT[key].items():
            setattr(ps, name, value)
    else:
        with _group_creation():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=layout.tp,
                pipeline_model_parallel_size=layout.pp,
                context_parallel_size=layout.cp,
                expert_model_parallel_size=layout.ep,
                expert_tensor_parallel_size=layout.etp,
                create_gloo_process_groups=use_cuda(),  # on CPU the default group is gloo already
            )
        _GROUPS_BY_LAYOUT[key] = _megatron_state()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda() else torch.device("cpu")
    return ParallelGroups(
        layout=layout,
        world_size=world,
        rank=dist.get_rank(),
        tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        ep=ps.get_expert_model_parallel_group(),
        cp=ps.get_context_parallel_group(),
        dp=ps.get_data_parallel_group(),
        dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
        expt_dp=ps.get_expert_data_parallel_group(),
        expt_tp=ps.get_expert_tensor_parallel_group(),
        mp=ps.get_model_parallel_group(),
        pg_collection=pgc,
        device=device,
    )


def _group_creation():
    """How megatron's groups are made: on CPU through the one-process shim (cpu_shims P10: a world of
    one process uses the default group for all of them), on CUDA as megatron makes them."""
    if use_cuda():
        import contextlib

        return contextlib.nullcontext()
    from megarl.learner.cpu_shims import one_process_groups

    return one_process_groups()


def destroy_parallel() -> None:
    """Tear down every layout's groups (the default process group stays): for the end of a process
    that switched layouts, after its models are gone."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    world = dist.group.WORLD if dist.is_initialized() else None
    seen: set[int] = set()
    for state in _GROUPS_BY_LAYOUT.values():
        for group in _groups_in(state.values()):
            if id(group) not in seen and group is not world:
                seen.add(id(group))
                dist.destroy_process_group(group)
    _GROUPS_BY_LAYOUT.clear()


def _groups_in(values) -> list:
    """The process groups among ``values`` (also inside lists, tuples and dicts)."""
    out = []
    for value in values:
        if isinstance(value, dist.ProcessGroup):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out += _groups_in(value)
        elif isinstance(value, dict):
            out += _groups_in(value.values())
    return out
