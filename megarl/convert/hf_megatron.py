"""Load HF safetensors into a sharded megatron-core model, and export it back to HF names.

Strict by design: a checkpoint with missing tensors, unknown names, unused names or wrong shapes
raises ``ConversionError`` listing every offending name; a model parameter without an HF source
does too. There is no partial load.

Export gathers TP shards (all-gather over the TP group), experts (broadcast from their EP owner)
and pipeline stages (broadcast over the PP group), and yields HF tensors in buckets of at most
``bucket_bytes`` (a single tensor larger than that is its own bucket). Every rank receives the
same buckets, so any rank can write or send them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megarl.convert.plan import Entry, build_plan, expected_hf_names
from megarl.learner.heads import is_head_parameter
from megarl.learner.model import ModelSpec
from megarl.learner.parallel import ParallelGroups


class ConversionError(ValueError):
    """A checkpoint or model does not match the conversion plan; the message names the keys."""


# ----------------------------------------------------------------------------- reading HF files
class HFSafetensorsReader:
    """Lazy reader over the ``*.safetensors`` files of a HF model directory."""

    def __init__(self, model_dir: str | os.PathLike):
        from safetensors import safe_open

        self.dir = os.fspath(model_dir)
        files = sorted(f for f in os.listdir(self.dir) if f.endswith(".safetensors"))
        if not files:
            raise ConversionError(f"{self.dir}: no *.safetensors file")
        self._where: dict[str, str] = {}
        self._open = {}
        for f in files:
            h = safe_open(os.path.join(self.dir, f), framework="pt")
            self._open[f] = h
            for k in h.keys():
                if k in self._where:
                    raise ConversionError(
                        f"{self.dir}: tensor '{k}' is stored twice ({self._where[k]} and {f})"
                    )
                self._where[k] = f

    def keys(self) -> list[str]:
        """All tensor names in the directory."""
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        """One tensor by HF name."""
        if name not in self._where:
            raise ConversionError(f"{self.dir}: no tensor '{name}'")
        return self._open[self._where[name]].get_tensor(name)


# ----------------------------------------------------------------------------- sharding math
def _qkv_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """HF q, k, v -> megatron's per-KV-group interleaved layout, shape [nkv, (nh/nkv + 2)·d, ...]."""
    ng, d = spec.num_kv_heads, spec.head_dim
    rest = tuple(q.shape[1:])
    qg = q.reshape(ng, (spec.num_heads // ng) * d, *rest)
    return torch.cat([qg, k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], dim=1)


def shard_hf(entry: Entry, hf: list[torch.Tensor], spec: ModelSpec, tp: int, r: int) -> torch.Tensor:
    """The TP rank ``r`` shard of the megatron parameter built from HF tensors ``hf``."""
    k = entry.kind
    if k == "replicated":
        return hf[0]
    if k in ("vocab", "column"):
        return hf[0].chunk(tp, dim=0)[r]
    if k == "row":
        return hf[0].chunk(tp, dim=1)[r]
    if k == "glu":
        return torch.cat([t.chunk(tp, dim=0)[r] for t in hf], dim=0)
    if k == "qkv":
        full = _qkv_full(*hf, spec)
        return full.chunk(tp, dim=0)[r].reshape(-1, *full.shape[2:])
    raise ConversionError(f"{entry.mcore_name}: unknown sharding kind '{k}'")


def unshard_to_hf(entry: Entry, shards: list[torch.Tensor], spec: ModelSpec) -> list[torch.Tensor]:
    """Inverse of ``shard_hf``: TP shards (rank order) -> the HF tensors of ``entry.hf_names``."""
    k = entry.kind
    if k == "replicated":
        return [shards[0]]
    if k in ("vocab", "column"):
        return [torch.cat(shards, dim=0)]
    if k == "row":
        return [torch.cat(shards, dim=1)]
    if k == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)]
    if k == "qkv":
        ng, d = spec.num_kv_heads, spec.head_dim
        qd = (spec.num_heads // ng) * d
        full = torch.cat(shards, dim=0)
        full = full.reshape(ng, qd + 2 * d, *full.shape[1:])
        q, kk, v = full.split([qd, d, d], dim=1)
        return [t.reshape(-1, *full.shape[2:]).contiguous() for t in (q, kk, v)]
    raise ConversionError(f"{entry.mcore_name}: unknown sharding kind '{k}'")


# ----------------------------------------------------------------------------- key checks
_KNOWN_HF = re.compile(
    r"^(model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight|"
    r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight|"
    r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj\.(weight|bias)|"
    r"model\.layers\.\d+\.self_attn\.(q|k)_norm\.weight|"
    r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight|"
    r"model\.layers\.\d+\.mlp\.gate\.weight|"
    r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight)$"
)


def check_hf_keys(names: list[str], plan: list[Entry], source: str) -> None:
    """Raise ``ConversionError`` if ``names`` differ from what ``plan`` reads, naming every key.

    unknown: not a tensor name this architecture has at all; unused: a valid-looking name this
    config does not use (a layer or expert beyond the config, lm_head of a tied model); missing:
    needed by the plan but absent.
    """
    expected = set(expected_hf_names(plan))
    have = set(names)
    missing = sorted(expected - have)
    extra = sorted(have - expected)
    unknown = [n for n in extra if not _KNOWN_HF.match(n)]
    unused = [n for n in extra if _KNOWN_HF.match(n)]
    if missing or unknown or unused:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {missing}")
        if unknown:
            parts.append(f"unknown {len(unknown)}: {unknown}")
        if unused:
            parts.append(f"unused {len(unused)}: {unused}")
        raise ConversionError(f"{source}: checkpoint keys do not match the model: " + "; ".join(parts))


def _local_entries(plan: list[Entry], groups: ParallelGroups) -> list[Entry]:
    return [
        e for e in plan if e.stage == groups.pp_rank and (e.expert is None or e.ep_owner == groups.ep_rank)
    ]


def _uses_te_names(model: torch.nn.Module) -> bool:
    return any(n.endswith("linear_qkv.layer_norm_weight") for n, _ in model.named_parameters())


def model_plan(model: torch.nn.Module, groups: ParallelGroups) -> list[Entry]:
    """The conversion plan of ``model`` (built by ``megarl.learner.model.build_gpt_model``)."""
    lay = groups.layout
    return build_plan(model.megarl_spec, pp=lay.pp, ep=lay.ep, te_names=_uses_te_names(model))


def _check_local_coverage(model: torch.nn.Module, mine: list[Entry]) -> dict[str, torch.nn.Parameter]:
    # extra output heads on the trunk (megarl/learner/heads.py) are not part of the HF model
    params = {n: p for n, p in model.named_parameters() if not is_head_parameter(n)}
    planned = {e.mcore_name for e in mine}
    not_in_model = sorted(planned - set(params))
    no_source = sorted(set(params) - planned)
    if not_in_model or no_source:
        raise ConversionError(
            f"model/plan mismatch on rank {dist.get_rank() if dist.is_initialized() else 0}: "
            f"planned but not in the model: {not_in_model}; "
            f"model parameters without an HF source: {no_source}"
        )
    return params


# ----------------------------------------------------------------------------- load
@torch.no_grad()
def load_hf_into_model(
    model: torch.nn.Module, groups: ParallelGroups, source: str | os.PathLike | dict[str, torch.Tensor]
) -> None:
    """Copy HF weights (a model directory of safetensors, or a name -> tensor dict) into this rank's
    shards of ``model``. Raises ``ConversionError`` on any key or shape mismatch."""
    spec: ModelSpec = model.megarl_spec
    plan = model_plan(model, groups)
    if isinstance(source, dict):
        getter, names, where = source.__getitem__, list(source), "state dict"
    else:
        reader = HFSafetensorsReader(source)
        getter, names, where = reader.get, reader.keys(), reader.dir
    check_hf_keys(names, plan, where)
    mine = _local_entries(plan, groups)
    params = _check_local_coverage(model, mine)
    bad_shapes = []
    for e in mine:
        tp, r = (
            (groups.layout.etp, groups.etp_rank)
            if e.expert is not None
            else (groups.layout.tp, groups.tp_rank)
        )
        shard = shard_hf(e, [getter(n) for n in e.hf_names], spec, tp, r)
        p = params[e.mcore_name]
        if tuple(shard.shape) != tuple(p.shape):
            bad_shapes.append(
                f"{e.mcore_name} from {list(e.hf_names)}: expected {tuple(p.shape)}, got {tuple(shard.shape)}"
            )
            continue
        p.data.copy_(shard.to(p.dtype))
    if bad_shapes:
        raise ConversionError(f"{where}: shape mismatch: " + "; ".join(bad_shapes))


# ----------------------------------------------------------------------------- export
def _broadcast_from(
    t: torch.Tensor | None,
    src_group_rank: int,
    group: dist.ProcessGroup,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Broadcast a tensor of unknown shape from group rank ``src_group_rank`` (shape goes first)."""
    me = dist.get_rank(group)
    src = dist.get_global_rank(group, src_group_rank)
    shape = torch.zeros(8, dtype=torch.long, device=device)
    if me == src_group_rank:
        shape[0] = t.dim()
        shape[1 : 1 + t.dim()] = torch.tensor(t.shape)
    dist.broadcast(shape, src=src, group=group)
    if me != src_group_rank:
        t = torch.empty(tuple(shape[1 : 1 + int(shape[0])].tolist()), dtype=dtype, device=device)
    else:
        t = t.contiguous()
    dist.broadcast(t, src=src, group=group)
    return t


def hf_tensor_names(model: torch.nn.Module, groups: ParallelGroups) -> list[str]:
    """The names ``iter_hf_tensors`` yields, in its order, from the plan alone (no communication)."""
    return [n for e in model_plan(model, groups) if not e.tied_copy for n in e.hf_names]


@torch.no_grad()
def iter_hf_tensors(model: torch.nn.Module, groups: ParallelGroups) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF-named tensor of the full model, in plan order, on every rank (collective)."""
    spec: ModelSpec = model.megarl_spec
    plan = model_plan(model, groups)
    params = _check_local_coverage(model, _local_entries(plan, groups))
    dtype = next(model.parameters()).dtype
    lay = groups.layout
    for e in plan:
        if e.tied_copy:
            continue
        on_stage = groups.pp_rank == e.stage
        tensors: list[torch.Tensor] | None = None
        if on_stage:
            p = params[e.mcore_name].detach()
            tp, tp_group = (lay.etp, groups.expt_tp) if e.expert is not None else (lay.tp, groups.tp)
            if e.expert is not None and lay.ep > 1:
                # the owner's shard (for this expert-TP rank) goes to every EP peer
                p = _broadcast_from(
                    p if groups.ep_rank == e.ep_owner else None, e.ep_owner, groups.ep, dtype, groups.device
                )
            if e.kind == "replicated" or tp == 1:
                tensors = unshard_to_hf(e, [p], spec)
            else:
                shards = [torch.empty_like(p) for _ in range(tp)]
                dist.all_gather(shards, p.contiguous(), group=tp_group)
                tensors = unshard_to_hf(e, shards, spec)
        if lay.pp > 1:
            tensors = [
                _broadcast_from(tensors[i] if on_stage else None, e.stage, groups.pp, dtype, groups.device)
                for i in range(len(e.hf_names))
            ]
        for name, t in zip(e.hf_names, tensors):
            yield name, t.cpu()


def iter_hf_buckets(
    model: torch.nn.Module, groups: ParallelGroups, bucket_bytes: int = 512 * 2**20
) -> Iterator[dict[str, torch.Tensor]]:
    """``iter_hf_tensors`` grouped into dicts of at most ``bucket_bytes`` (collective, all ranks)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in iter_hf_tensors(model, groups):
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket


def _remove_stale_temp(tmp: str) -> None:
    """Remove ``tmp`` (file, link or directory), the leftover of an export killed before its rename."""
    if os.path.isdir(tmp) and not os.path.islink(tmp):
        shutil.rmtree(tmp)
    elif os.path.lexists(tmp):
        os.remove(tmp)


def save_hf_checkpoint(
    model: torch.nn.Module,
    groups: ParallelGroups,
    out_dir: str | os.PathLike,
    hf_config: dict | None = None,
    bucket_bytes: int = 512 * 2**20,
    writer_rank: int = 0,
) -> dict[str, str] | None:
    """Write the model as HF safetensors shards (one file per bucket) + index (+ config.json).

    Collective. Rank ``writer_rank`` writes into a temporary sibling directory, then renames it to
    ``out_dir`` (which must not exist), so readers never see a half-written checkpoint. A
    temporary directory left by an export that was killed is stale: it is removed first.
    Returns the weight map on the writer rank, None elsewhere.
    """
    from safetensors.torch import save_file

    out_dir = os.fspath(out_dir)
    writer = dist.get_rank() == writer_rank
    tmp = out_dir + ".tmp-megarl"
    if writer:
        if os.path.exists(out_dir):
            raise FileExistsError(f"{out_dir} exists; refusing to overwrite a checkpoint")
        _remove_stale_temp(tmp)
        os.makedirs(tmp, exist_ok=False)
    weight_map: dict[str, str] = {}
    for i, bucket in enumerate(iter_hf_buckets(model, groups, bucket_bytes)):
        if writer:
            fname = f"model-{i:05d}.safetensors"
            save_file(
                {k: v.contiguous() for k, v in bucket.items()},
                os.path.join(tmp, fname),
                metadata={"format": "pt"},
            )
            weight_map.update({k: fname for k in bucket})
    if writer:
        total = 0
        for f in set(weight_map.values()):
            total += os.path.getsize(os.path.join(tmp, f))
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        if hf_config is not None:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(hf_config, f, indent=1)
        os.rename(tmp, out_dir)
    dist.barrier()
    return weight_map if writer else None
