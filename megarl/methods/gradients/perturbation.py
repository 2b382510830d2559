"""Seeded weight perturbation of a sharded megatron model, restored bit for bit.

Every element of every parameter is addressed by its HF tensor name and its flat index in that HF
tensor (the layout-free coordinates the converter uses, megarl/convert/plan.py). The noise of an
element is ``noise.gaussian(tensor_key(seed, hf_name), hf_index)``, so each TP / PP / EP shard
regenerates exactly its slice, a tied output layer gets its embedding's noise, and the full noise
equals the unsharded model's under any layout (and the HF-space noise of reference/perturbation.py).

``WeightPerturbation(model, groups)`` (no collectives):

- ``perturb(seed, sigma)``: ``θ ← θ + σ·ε(seed)``, computed in float32 and stored in the
  parameters' dtype. Before writing, it records, per chunk, the elements where subtracting the same
  noise again would not give the old bits back (``fl(fl(θ+σε)−σε) ≠ θ``) with their old values, or
  a copy of the chunk where that record would be larger (at most the parameters' own size);
- ``restore()``: subtracts the regenerated noise and writes the recorded elements back (or copies the
  chunk back): the parameters are bit-identical to before ``perturb``;
- ``add_noise_sum(seeds, coeffs)``: ``θ ← θ + Σ_n c_n ε(seed_n)`` (the ES update), float32 params only.

With float32 parameters megatron's distributed optimizer steps on views of the parameters, so the
perturbation acts on the fp32 master weights themselves and ``restore`` returns them exactly; with
bfloat16 parameters the fp32 master copy is never touched (the bf16 weights the forward pass and
the engine see are perturbed and restored exactly).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megarl.methods.gradients.noise import gaussian, tensor_key

# elements per noise chunk (counters and hash temporaries are int64 / float64)
CHUNK_ELEMENTS = 1 << 22


@dataclass
class ParamNoise:
    """Where one local parameter's elements sit in HF space: row ``i`` of the (2-D view of the)
    parameter has HF flat index ``row_base[i] + cols`` in the HF tensor with key ``(k0[i], k1[i])``
    (per seed); ``names[key_ids[i]]`` is that tensor's HF name."""

    name: str
    param: torch.nn.Parameter
    names: tuple[str, ...]
    key_ids: torch.Tensor  # [R] int64, index into names
    row_base: torch.Tensor  # [R] int64
    cols: torch.Tensor  # [C] int64

    def noise(self, seed: int, rows: slice | None = None) -> torch.Tensor:
        """Standard normals of rows ``rows`` of this parameter (float32, shape [r, C])."""
        rows = rows or slice(0, self.row_base.numel())
        dev = self.param.device  # generated where the parameter lives
        keys = torch.tensor([tensor_key(seed, n) for n in self.names], dtype=torch.int64, device=dev)
        ids = self.key_ids[rows].to(dev)
        k0, k1 = keys[ids, 0].unsqueeze(1), keys[ids, 1].unsqueeze(1)
        counters = self.row_base[rows].to(dev).unsqueeze(1) + self.cols.to(dev).unsqueeze(0)
        return gaussian(k0, k1, counters)

    def row_chunks(self) -> Iterator[slice]:
        """Row ranges of about ``CHUNK_ELEMENTS`` elements."""
        R, C = self.row_base.numel(), max(1, self.cols.numel())
        step = max(1, CHUNK_ELEMENTS // C)
        for a in range(0, R, step):
            yield slice(a, min(R, a + step))

    def view2d(self) -> torch.Tensor:
        """The parameter's data as [R, C] (a view)."""
        return self.param.data.view(self.row_base.numel(), self.cols.numel())


def _hf_rows(entry, shape: tuple[int, ...], spec, tp: int) -> list[int]:
    """Row counts of the HF tensors of ``entry`` whose TP shard has ``shape``."""
    k, rows = entry.kind, shape[0]
    if k in ("replicated", "row"):
        return [rows]
    if k in ("vocab", "column"):
        return [rows * tp]
    if k == "glu":
        return [rows // 2 * tp] * 2
    if k == "qkv":
        return [spec.num_heads * spec.head_dim] + [spec.num_kv_heads * spec.head_dim] * 2
    raise ValueError(f"{entry.mcore_name}: unknown sharding kind '{k}'")


def param_noise_map(entry, param: torch.nn.Parameter, spec, tp: int, r: int) -> ParamNoise:
    """The HF coordinates of the TP-rank-``r`` shard ``param`` of ``entry``."""
    from megarl.convert.hf_megatron import shard_hf

    shape = tuple(param.shape)
    if param.dim() not in (1, 2):
        raise ValueError(f"{entry.mcore_name}: perturbation supports 1-D and 2-D parameters, got {shape}")
    C = shape[1] if param.dim() == 2 else 1
    if entry.kind == "row":
        full_c = C * tp
        row_base = torch.arange(shape[0], dtype=torch.int64) * full_c
        cols = r * C + torch.arange(C, dtype=torch.int64)
        key_ids = torch.zeros(shape[0], dtype=torch.int64)
    else:
        hf_rows = _hf_rows(entry, shape, spec, tp)
        rows = [torch.arange(n, dtype=torch.int64) for n in hf_rows]
        ids = [torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(hf_rows)]
        if entry.kind == "replicated":
            local_rows, key_ids = rows[0], ids[0]
        else:
            local_rows = shard_hf(entry, rows, spec, tp, r)
            key_ids = shard_hf(entry, ids, spec, tp, r)
        row_base = local_rows * C
        cols = torch.arange(C, dtype=torch.int64)
    if row_base.numel() * cols.numel() != param.numel():
        raise ValueError(
            f"{entry.mcore_name}: HF coordinates cover {row_base.numel() * cols.numel()} "
            f"elements, the parameter has {param.numel()}"
        )
    return ParamNoise(entry.mcore_name, param, tuple(entry.hf_names), key_ids, row_base, cols)


def model_noise_maps(model: torch.nn.Module, groups) -> list[ParamNoise]:
    """One ``ParamNoise`` per parameter of this rank's part of ``model`` (plan order)."""
    from megarl.convert.hf_megatron import model_plan

    spec, lay = model.megarl_spec, groups.layout
    params = dict(model.named_parameters())
    out = []
    for e in model_plan(model, groups):
        if e.stage != groups.pp_rank or (e.expert is not None and e.ep_owner != groups.ep_rank):
            continue
        if e.mcore_name not in params:
            raise ValueError(f"planned parameter {e.mcore_name} is not in the model")
        tp, r = (lay.etp, groups.etp_rank) if e.expert is not None else (lay.tp, groups.tp_rank)
        out.append(param_noise_map(e, params[e.mcore_name], spec, tp, r))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


class WeightPerturbation:
    """See the module docstring. ``maps``: the model's ``model_noise_maps``."""

    def __init__(self, maps: list[ParamNoise]):
        self.maps = maps
        self._active: tuple[int, float] | None = None
        self._patch: list = []  # per chunk: (map, rows, (int32 indices, old values) or (None, a copy))
        self.patched_elements = 0  # elements restored from the record at the last restore
        self.recorded_bytes = 0  # the record's size at the last restore

    @classmethod
    def of_model(cls, model: torch.nn.Module, groups) -> WeightPerturbation:
        """The perturbation of ``model``'s parameters on this rank."""
        return cls(model_noise_maps(model, groups))

    @property
    def active(self) -> tuple[int, float] | None:
        """(seed, sigma) of the perturbation in place, or None."""
        return self._active

    @torch.no_grad()
    def perturb(self, seed: int, sigma: float) -> None:
        """``θ ← θ + σ·ε(seed)`` in place (see the module docstring)."""
        if self._active is not None:
            raise RuntimeError(
                f"weights already perturbed with (seed, sigma) = {self._active}; restore first"
            )
        self._patch = []
        for m in self.maps:
            w = m.view2d()
            for rows in m.row_chunks():
                old = w[rows]
                eps = sigma * m.noise(seed, rows)
                new = (old.float() + eps).to(old.dtype)
                back = (new.float() - eps).to(old.dtype)
                bad = (_bits(back) != _bits(old)).flatten().nonzero().flatten()
                size = old.element_size()
                if bad.numel() * (4 + size) < old.numel() * size:  # the record is smaller than a copy
                    rec = (bad.to(torch.int32), old.flatten()[bad].clone())
                else:
                    rec = (None, old.clone())
                self._patch.append((m, rows, rec))
                old.copy_(new)
        self._active = (int(seed), float(sigma))

    @torch.no_grad()
    def restore(self) -> None:
        """Undo ``perturb`` bit for bit."""
        if self._active is None:
            raise RuntimeError("restore() without a perturbation in place")
        seed, sigma = self._active
        n = 0
        for m, rows, (idx, vals) in self._patch:
            cur = m.view2d()[rows]
            if idx is None:  # a copy of the chunk was cheaper than the record
                cur.copy_(vals)
                n += vals.numel()
                continue
            cur.copy_((cur.float() - sigma * m.noise(seed, rows)).to(cur.dtype))
            if idx.numel():
                cur.view(-1)[idx.long()] = vals
                n += idx.numel()
        self.recorded_bytes = sum(
            v.numel() * v.element_size() + (0 if i is None else i.numel() * 4) for _, _, (i, v) in self._patch
        )
        self.patched_elements = n
        self._patch, self._active = [], None

    @contextlib.contextmanager
    def applied(self, seed: int, sigma: float) -> Iterator[None]:
        """``perturb(seed, sigma)`` for the duration of the block, then ``restore()``."""
        self.perturb(seed, sigma)
        try:
            yield
        finally:
            self.restore()

    @torch.no_grad()
    def add_noise_sum(self, seeds: list[int], coeffs: list[float]) -> None:
        """``θ ← θ + Σ_n coeffs[n]·ε(seeds[n])`` (summed in float32 in the order given)."""
        if self._active is not None:
            raise RuntimeError("add_noise_sum on perturbed weights; restore first")
        if len(seeds) != len(coeffs):
            raise ValueError(f"{len(seeds)} seeds but {len(coeffs)} coefficients")
        for m in self.maps:
            if m.param.dtype != torch.float32:
                raise ValueError(
                    f"{m.name}: the noise-sum update needs float32 parameters (model.params_dtype: float32), "
                    f"got {m.param.dtype}"
                )
            w = m.view2d()
            for rows in m.row_chunks():
                delta = torch.zeros_like(w[rows])
                for s, c in zip(seeds, coeffs):
                    delta += float(c) * m.noise(s, rows)
                w[rows] += delta

    def local_noise(self, seed: int) -> dict[str, torch.Tensor]:
        """Every local parameter's standard-normal noise under ``seed`` (megatron name -> tensor)."""
        return {m.name: m.noise(seed).view_as(m.param) for m in self.maps}
