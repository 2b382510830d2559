"""Step dumps: everything needed to run one trainer step's optimizer steps again, elsewhere.

Layout of ``DUMP = run_dir/dumps/step_000003/``::

    dump.json        step, why (events / dump_steps), the model's shape, the learner layout, the
                     run config, the injections of the step, per-optimizer-step recorded metrics
                     (loss, grad_norm, ...), the detector baselines, torch threads, a pointer to the
                     run checkpoint of the previous step when one exists
    batches.pt       per optimizer step: the exact PackedBatch the learner got (after any poison),
                     its number of micro-batches and global normalisers; with data parallelism the
                     shares of every DP rank too (``dp_shares``, in DP-rank order); when the step
                     poisoned the batch, the batch before the poison (``clean_batch``,
                     ``clean_dp_shares``)
    state.pt         objective state and learner step BEFORE the step, torch / Python RNG states
    weights/         the policy weights BEFORE the step as a HF checkpoint (config.json +
                     safetensors, the names megarl.convert writes): what ``--model`` defaults to
    learner/         (dump_steps only) the full learner state before the step: a megarl learner
                     checkpoint (weights, Adam moments, LR schedule, RNG)

Written into ``step_NNNNNN.tmp`` and renamed, so a dump directory is always complete.

Dumps are shared between people, so ``batches.pt`` and ``state.pt`` hold plain containers only
(dicts, lists, tuples, str, numbers, None, tensors) and are read with ``torch.load(...,
weights_only=True)``: a file holding any other pickled object is refused, never executed.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import pickle
import shutil
import warnings
from pathlib import Path

import torch

from megarl.batch import PackedBatch
from megarl.objectives.api import GlobalNormalisers

DUMP_META = "dump.json"
DUMP_BATCHES = "batches.pt"
DUMP_STATE = "state.pt"
DUMP_WEIGHTS = "weights"
DUMP_LEARNER = "learner"

# HF config keys that must agree between the dumped model and a replay model. Expert count and
# top-k may differ (that is what a proxy changes).
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


class DumpError(ValueError):
    """A dump is missing, incomplete, or does not fit the model it is replayed on."""


def batch_to_dict(b: PackedBatch) -> dict:
    """A PackedBatch as a plain dict of its fields (tensors stay tensors), for torch.save."""
    return {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}


def batch_from_dict(d: dict) -> PackedBatch:
    """Inverse of ``batch_to_dict``; checks the batch."""
    names = {f.name for f in dataclasses.fields(PackedBatch)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise DumpError(f"batch field {unknown[0]!r} is not a PackedBatch field (dump from another version?)")
    return PackedBatch(**d).validate()


def concat_batches(parts: list[PackedBatch]) -> PackedBatch:
    """The sequences of ``parts`` in order as one PackedBatch (the data-parallel shares of one
    optimizer step -> the global batch). Per-token and per-sequence fields are concatenated,
    ``cu_seqlens`` offset; a field must be present in all parts or in none."""
    from megarl.batch import TOKEN_FIELDS

    if len(parts) == 1:
        return parts[0]
    kw: dict = {}
    for f in dataclasses.fields(PackedBatch):
        vals = [getattr(b, f.name) for b in parts]
        if f.name == "cu_seqlens":
            lens = torch.cat([b.seq_lens for b in parts])
            cu = torch.zeros(lens.numel() + 1, dtype=torch.long)
            cu[1:] = torch.cumsum(lens, 0)
            kw[f.name] = cu
        elif f.name in ("extras", "token_extras"):
            kw[f.name] = {k: torch.cat([v[k] for v in vals]) for k in vals[0]}
        elif all(v is None for v in vals):
            kw[f.name] = None
        elif any(v is None for v in vals):
            raise DumpError(f"batch field {f.name!r} is set in some data-parallel shares only")
        elif f.name == "turn_spans":
            kw[f.name] = [s for v in vals for s in v]
        elif f.name == "reward_names":
            kw[f.name] = vals[0]
        elif isinstance(vals[0], torch.Tensor) or f.name in TOKEN_FIELDS:
            kw[f.name] = torch.cat(vals)
        else:
            kw[f.name] = vals[0]
    return PackedBatch(**kw).validate()


def model_shape(hf_config: dict) -> dict:
    """The shape-defining keys of a HF config, with the routed-expert count and top-k."""
    out = {k: hf_config.get(k) for k in SHAPE_KEYS}
    if out["head_dim"] is None and hf_config.get("hidden_size") and hf_config.get("num_attention_heads"):
        out["head_dim"] = hf_config["hidden_size"] // hf_config["num_attention_heads"]
    if out["num_key_value_heads"] is None:
        out["num_key_value_heads"] = hf_config.get("num_attention_heads")
    out["num_experts"] = int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)
    out["num_experts_per_tok"] = int(hf_config.get("num_experts_per_tok") or 0)
    return out


def check_compatible(
    dumped: dict, hf_config: dict, model_dir: str, uses_routes: bool = False, ref: str = "dump"
) -> list[str]:
    """Raise ``DumpError`` when the model at ``model_dir`` cannot stand in for ``dumped`` (the
    ``model_shape`` of the run, called ``ref`` in messages); returns notes on accepted
    differences (fewer experts)."""
    have = model_shape(hf_config)
    bad = [f"{k}: {ref} {dumped.get(k)!r}, model {have[k]!r}" for k in SHAPE_KEYS if dumped.get(k) != have[k]]
    if bool(dumped.get("num_experts")) != bool(have["num_experts"]):
        bad.append(
            f"num_experts: {ref} {dumped.get('num_experts')}, model {have['num_experts']} (dense vs MoE)"
        )
    if bad:
        raise DumpError(f"model {model_dir} does not fit the {ref}: " + "; ".join(bad))
    notes = []
    if have["num_experts"] != dumped.get("num_experts"):
        if uses_routes:
            raise DumpError(
                f"model {model_dir} has {have['num_experts']} experts, the dump {dumped['num_experts']}, "
                "and the dumped batch replays recorded routes (routed_experts): expert ids do not "
                "carry over to a model with other experts"
            )
        notes.append(
            f"proxy: {have['num_experts']} routed experts (top-{have['num_experts_per_tok']}) instead "
            f"of {dumped['num_experts']} (top-{dumped['num_experts_per_tok']})"
        )
    return notes


def plain(x, where: str = "state"):
    """``x`` as plain containers a weights-only ``torch.load`` accepts: dataclasses become dicts,
    numpy arrays tensors, numpy scalars Python numbers; raise ``DumpError`` naming the key path
    (``where``) of anything else."""
    if x is None or type(x) in (bool, int, float, str) or isinstance(x, torch.Tensor):
        return x
    if isinstance(x, str):
        return str(x)
    if type(x).__module__ == "numpy":
        import numpy as np

        if isinstance(x, np.ndarray):
            return torch.from_numpy(x.copy())
        if isinstance(x, np.generic):
            return x.item()
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: plain(getattr(x, f.name), f"{where}.{f.name}") for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {_plain_key(k, where): plain(v, f"{where}[{k!r}]") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        vals = [plain(v, f"{where}[{i}]") for i, v in enumerate(x)]
        return vals if isinstance(x, list) else tuple(vals)
    if isinstance(x, bool):
        return bool(x)
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    raise DumpError(
        f"{where}: a {type(x).__module__}.{type(x).__qualname__} cannot go into a dump "
        "(only dicts, lists, tuples, str, numbers, None and tensors load weights-only)"
    )


def _plain_key(k, where: str):
    """A dict key of a dump: str, int, float, bool, None or a tuple of them."""
    if k is None or isinstance(k, (str, int, float, bool)):
        return k
    if isinstance(k, tuple):
        return tuple(_plain_key(x, where) for x in k)
    raise DumpError(f"{where}: dict key {k!r} ({type(k).__name__}) cannot go into a dump")


def load_plain(path: Path):
    """``torch.load(path, weights_only=True)``; a file holding anything but plain containers and
    tensors (a pickle that would run code, a class from another program) is a ``DumpError`` naming
    the file."""
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols before refusing a file
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise DumpError(
            f"{path}: refused: not a plain megarl dump file ({_load_failure(e)}); dump files "
            "are read weights-only and may hold only dicts, lists, tuples, str, numbers, None "
            "and tensors"
        ) from None


def _load_failure(e: BaseException) -> str:
    """The informative line of a ``torch.load`` failure (torch's first line is boilerplate)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:
        if not ln.startswith(("Weights only load failed", "Check the documentation", "Please file an issue")):
            return ln
    return lines[0] if lines else type(e).__name__


def write_dump(
    out_dir: Path,
    meta: dict,
    batches: list[dict],
    state: dict,
    weights: dict[str, torch.Tensor] | None,
    hf_config: dict,
    learner_dir: Path | None = None,
    side_files_from: str | None = None,
) -> Path:
    """Write a dump atomically (rank 0 only). ``batches``: [{batch: PackedBatch, num_micro_batches,
    normalisers: GlobalNormalisers}]; ``weights``: HF-named tensors before the step (None: the dump
    points to ``meta['checkpoint_before']`` only); ``learner_dir``: a megarl learner checkpoint of
    the state before the step, moved into the dump as ``learner/``; ``side_files_from``: the run's
    HF checkpoint, whose tokenizer and generation files are copied next to the weights (so a proxy
    can be pruned from ``weights/``)."""
    from safetensors.torch import save_file

    raw_batches = plain(
        [
            {
                "batch": batch_to_dict(b["batch"]),
                "num_micro_batches": int(b["num_micro_batches"]),
                "normalisers": dataclasses.asdict(b["normalisers"]),
                "dp_shares": [batch_to_dict(x) for x in b.get("dp_shares") or []],
                **(
                    {
                        "clean_batch": batch_to_dict(b["clean_batch"]),
                        "clean_dp_shares": [batch_to_dict(x) for x in b.get("clean_dp_shares") or []],
                    }
                    if b.get("clean_batch") is not None
                    else {}
                ),
            }
            for b in batches
        ],
        "batches",
    )
    raw_state = plain(state, "state")
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.mkdir(parents=True)
    torch.save(raw_batches, tmp / DUMP_BATCHES)
    torch.save(raw_state, tmp / DUMP_STATE)
    if weights is not None:
        wdir = tmp / DUMP_WEIGHTS
        wdir.mkdir()
        save_file(
            {k: v.contiguous() for k, v in weights.items()},
            str(wdir / "model.safetensors"),
            metadata={"format": "pt"},
        )
        (wdir / "config.json").write_text(json.dumps(hf_config, indent=1))
        copy_side_files(side_files_from, wdir)
        meta = dict(meta, weights=DUMP_WEIGHTS)
    if learner_dir is not None and Path(learner_dir).is_dir():
        os.rename(learner_dir, tmp / DUMP_LEARNER)
        meta = dict(meta, learner_state=DUMP_LEARNER)
    (tmp / DUMP_META).write_text(json.dumps(meta, indent=1, default=str))
    os.rename(tmp, out_dir)
    return out_dir


# files of an HF checkpoint that are not the weights or the model config: tokenizer, generation
# config, chat template (what `megarl proxy prune` needs to tokenize calibration text)
_NOT_SIDE_FILES = ("config.json", "proxy_report.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".gguf", ".h5", ".msgpack")


def copy_side_files(src: str | os.PathLike | None, dst: Path) -> list[str]:
    """Copy the tokenizer / generation files of checkpoint ``src`` into ``dst``; returns their names."""
    if not src or not Path(src).is_dir():
        return []
    out = []
    for p in sorted(Path(src).iterdir()):
        if p.is_file() and p.name not in _NOT_SIDE_FILES and not p.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copyfile(p, dst / p.name)
            out.append(p.name)
    return out


def read_dump(dump_dir: str | os.PathLike) -> tuple[dict, list[dict], dict]:
    """(meta, batches, state) of a dump; batches hold PackedBatch / GlobalNormalisers again."""
    d = Path(dump_dir)
    if not d.is_dir():
        raise DumpError(f"dump {d} does not exist")
    for name in (DUMP_META, DUMP_BATCHES, DUMP_STATE):
        if not (d / name).is_file():
            raise DumpError(f"dump {d} has no {name} (not a megarl step dump, or incomplete)")
    try:
        meta = json.loads((d / DUMP_META).read_text())
    except json.JSONDecodeError as e:
        raise DumpError(f"{d / DUMP_META}: not valid JSON: {e}") from None
    raw = load_plain(d / DUMP_BATCHES)
    if not isinstance(raw, list) or not all(isinstance(r, dict) and "batch" in r for r in raw):
        raise DumpError(f"{d / DUMP_BATCHES}: expected a list of per-optimizer-step dicts with a 'batch'")
    batches = [
        {
            "batch": batch_from_dict(r["batch"]),
            "num_micro_batches": r["num_micro_batches"],
            "normalisers": GlobalNormalisers(**r["normalisers"]),
            "dp_shares": [batch_from_dict(x) for x in r.get("dp_shares") or []],
            "clean_batch": batch_from_dict(r["clean_batch"]) if r.get("clean_batch") is not None else None,
            "clean_dp_shares": [batch_from_dict(x) for x in r.get("clean_dp_shares") or []],
        }
        for r in raw
    ]
    state = load_plain(d / DUMP_STATE)
    if not isinstance(state, dict):
        raise DumpError(f"{d / DUMP_STATE}: expected a dict, got {type(state).__name__}")
    return meta, batches, state


def default_weights(dump_dir: str | os.PathLike, meta: dict) -> str | None:
    """The dump's own pre-step HF weights directory, if it has one."""
    w = meta.get("weights")
    return str(Path(dump_dir) / w) if w else None
