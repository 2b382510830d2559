"""Every examples/methods/*.yaml for a few RL steps in ONE trainer process group (one model type).

    python tests/trainer/method_smoke.py --model dense --out results.jsonl [--only gepo,eppo]
    torchrun --nproc-per-node 2 tests/trainer/method_smoke.py --model moe --out results.jsonl

The run is the quickstart (examples/quickstart.yaml or examples/quickstart-moe.yaml), shrunk. The
expensive parts are shared by all examples: process group, parallel layout, data, the embedded
engine and the initial policy (a short supervised warm-up, written once). Per example the real
trainer code builds what a run builds (``Trainer._build_policy_and_method``: a fresh learner and
optimizer holding the initial policy, the reference when needed, the objective, the method inputs;
``Trainer._rank0_methods``: the reward shaper / judge / RRPO scorer), resets the engine to the
initial weights and the sampler, and runs ``Trainer._step`` ``--steps`` times.

Per example, rank 0 prints (and appends to ``--out``) one JSON line: the metrics of every step,
the largest parameter change (max over ranks), the method's checkpoint state after a save/load
round trip, and ``error`` when the example failed (the loop goes on with the next one).

The distillation example's teacher is the policy's architecture with other random weights
(written once by ``_setup``). The smoke base adds one reward dimension to the quickstart's exact match (``format``: the
response is digits only, weight 0.5), so that two steps of a barely warmed-up model see non-zero
advantages; examples with their own ``reward.functions`` keep theirs.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "methods"
QUICKSTART = {"dense": ROOT / "examples" / "quickstart.yaml", "moe": ROOT / "examples" / "quickstart-moe.yaml"}

# Examples the trainer cannot run yet, with the reason (the pytest side reports them as skipped).
UNSUPPORTED: dict[str, str] = {}

FORMAT_REWARD = {"name": "format", "kind": "regex", "pattern": r"^\d+$", "weight": 0.5}


def example_names() -> list[str]:
    """Every example file's stem, sorted."""
    return sorted(p.stem for p in EXAMPLES.glob("*.yaml"))


def merge(base: dict, over: dict) -> dict:
    """``over``'s sections into ``base``: mappings merged key by key, anything else replaced."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in ("advantage", "objective"):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def base_config(model: str, work: Path, steps: int) -> dict:
    """The quickstart config of ``model``, shrunk to a smoke run under ``work``."""
    d = yaml.safe_load(QUICKSTART[model].read_text())
    return merge(d, {
        "data": {"train": str(work / "train.jsonl"), "eval": str(work / "eval.jsonl"),
                 "generate": {"num_train": 64, "num_eval": 4}},
        "reward": {"functions": list(d["reward"]["functions"]) + [FORMAT_REWARD]},
        "warmup": {"sft_steps": 6, "batch_size": 32},
        "rollout": {"n": 4, "max_new_tokens": 6},
        # 2 mini-batches: the second optimizer step is off-policy, so clipping, trust regions and
        # corrections act (with one, every ratio is 1 and most losses coincide)
        "schedule": {"steps": steps, "prompts_per_step": 4, "mini_batches": 2, "micro_batches": 1,
                     "eval_every": 0, "eval_samples": 4, "eval_k": 1},
        "optimizer": {"lr_warmup_steps": 0},  # both steps update the weights
        "checkpoint": {"every": 1000},
        "credit": {"rrpo": {"anchors": 2, "head_steps": 5}},
        "teacher": {"hf_dir": str(work / "teacher")},  # written by _setup (on-policy distillation)
        "logging": {"run_dir": str(work / "run"), "plot": False},
    })


def example_config(base: dict, name: str) -> dict:
    """``base`` with the example's sections spliced in (advantage and objective replaced whole)."""
    ex = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()) or {}
    d = merge(base, ex)
    if "reward" in ex and "functions" in ex["reward"]:
        d["reward"]["functions"] = ex["reward"]["functions"]
    d["reward"].setdefault("judge", {}).setdefault("max_new_tokens", 4)
    return d


def _params(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.learner.model.parameters()]


def _max_change(before: list[torch.Tensor], trainer) -> float:
    d = max((float((p.detach() - b).abs().max()) for p, b in zip(trainer.learner.model.parameters(), before)),
            default=0.0)
    t = torch.tensor([d], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _state_summary(trainer) -> dict:
    """The method state a checkpoint would hold, after a torch.save/load round trip, restored into
    freshly built parts (the resume path); returns its keys per part."""
    from megarl.objectives.rl_objective import build_objective
    from megarl.trainer.method_inputs import MethodInputs

    obj = _roundtrip(trainer.objective.state_dict())
    build_objective(trainer.cfg.objective).load_state_dict(obj)
    meth = _roundtrip(trainer._method_state())
    MethodInputs(trainer.cfg).load_state_dict(meth.get("inputs", {}))
    if dist.get_rank() == 0:
        shaping, _ = trainer._rank0_methods(meth)  # loads the saved shaper/head state
        if shaping is not None:
            assert shaping.state_dict().keys() == meth["shaping"].keys()
    return {"objective": sorted(obj), "method": {k: sorted(v) if isinstance(v, dict) else v for k, v in meth.items()}}


def _setup(trainer, model: str) -> Path:
    """Everything the examples share: process group, layout, data, initial policy, engine."""
    from megarl.data.dataset import PromptSampler
    from megarl.learner.parallel import ParallelLayout, init_distributed, initialize_parallel
    from megarl.trainer.config import check_layout
    from megarl.trainer.loop import INIT_POLICY

    cfg = trainer.cfg
    tok, hf = trainer._tokenizer_and_hf_config()
    check_layout(cfg, hf, int(os.environ.get("WORLD_SIZE", "1")))
    init_distributed()
    trainer.tok, trainer.hf = tok, hf
    # rank 0 writes the dataset first (the other ranks read it)
    if dist.get_rank() == 0:
        trainer.train_ds, trainer.eval_ds = trainer._load_data(tok)
    dist.barrier()
    if dist.get_rank() != 0:
        trainer.train_ds, trainer.eval_ds = trainer._load_data(tok)
    p = cfg.parallel
    trainer.groups = initialize_parallel(ParallelLayout(tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp,
                                                        sequence_parallel=p.sequence_parallel, expert_tp=p.expert_tp),
                                         seed=cfg.model.seed)
    trainer.failures_total = {"errors": 0, "timeouts": 0}
    trainer.sampler = PromptSampler(len(trainer.train_ds), cfg.schedule.seed)
    init_dir = trainer.run_dir / INIT_POLICY
    if dist.get_rank() == 0:
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    trainer._warmup(init_dir)
    _write_teacher(trainer, Path(cfg.teacher.hf_dir))
    dist.barrier()
    trainer.engine = trainer._make_engine() if dist.get_rank() == 0 else None
    trainer.loop = trainer._make_event_loop()
    return init_dir


def _fault_monitor(trainer) -> None:
    """What ``Trainer.run`` builds beside the learner when the config has a ``faults`` section."""
    if not hasattr(trainer.cfg, "faults"):
        return
    from megarl.faults.monitor import FaultMonitor
    from megarl.trainer.config import to_dict

    trainer.faults = FaultMonitor(trainer.cfg.faults, trainer.learner, trainer.groups, trainer.run_dir, trainer.hf,
                                  to_dict(trainer.cfg), [])


def _write_teacher(trainer, out: Path) -> None:
    """A teacher for the distillation example: the policy's architecture with other random weights
    (model.seed + 1), written in megarl's HF export format (collective)."""
    import dataclasses

    from megarl.convert.hf_megatron import save_hf_checkpoint
    from megarl.trainer.policy import build_learner

    if out.is_dir():
        return
    cfg = trainer.cfg
    tcfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seed=cfg.model.seed + 1))
    ln = build_learner(tcfg, trainer.hf, trainer.groups, trainable=False)
    save_hf_checkpoint(ln.model, trainer.groups, out, hf_config=trainer.hf)
    del ln


def run_example(trainer, name: str, cfg, init_dir: Path, steps: int) -> dict:
    """Build the example's parts with the trainer's own code and run ``steps`` steps."""
    from megarl.data.dataset import PromptSampler
    from megarl.rewards.compute import RewardComputer

    rank0 = dist.get_rank() == 0
    if rank0 and getattr(trainer, "rewards", None) is not None:
        trainer.rewards.close()
    trainer.cfg = cfg
    trainer.rewards = RewardComputer(cfg.reward) if rank0 else None
    trainer.sampler = PromptSampler(len(trainer.train_ds), cfg.schedule.seed)
    trainer._build_policy_and_method(init_dir)
    _fault_monitor(trainer)
    trainer.shaping, trainer.rrpo = trainer._rank0_methods({}) if rank0 else (None, None)
    trainer._sync_weights(version=0)  # the engine back to the initial policy
    before = _params(trainer)
    recs = []
    for s in range(1, steps + 1):
        t0 = time.time()
        rec = trainer._step(s)
        rec["wall_s"] = time.time() - t0
        recs.append({k: v for k, v in rec.items() if isinstance(v, (int, float, str))})
    return {"steps": recs, "param_change": _max_change(before, trainer), "state": _state_summary(trainer)}


def main(argv: list[str] | None = None) -> int:
    """Run the examples; one JSON line per example on rank 0."""
    from megarl.trainer.config import apply_overrides, from_dict
    from megarl.trainer.loop import Trainer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(QUICKSTART), default="dense")
    ap.add_argument("--work", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--out", default=None, help="append the JSON lines here too")
    ap.add_argument("--only", default="", help="comma-separated example names (default: all)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override of the smoke base config (section.key=value), repeatable")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("MEGARL_NUM_THREADS", "1")))
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="megarl-smoke-"))
    base = apply_overrides(base_config(args.model, work, args.steps), args.set)
    names = [n for n in (args.only.split(",") if args.only else example_names()) if n]
    t_all = time.time()
    trainer = Trainer(from_dict(base))
    init_dir = _setup(trainer, args.model)
    rank0 = dist.get_rank() == 0
    for name in names:
        t0 = time.time()
        res: dict = {"example": name, "model": args.model}
        if name in UNSUPPORTED:
            res["unsupported"] = UNSUPPORTED[name]
        else:
            try:
                cfg = from_dict(example_config(base, name))
                res.update(run_example(trainer, name, cfg, init_dir, args.steps))
            except Exception as e:  # reported per example; the pytest side fails that example
                res["error"] = f"{type(e).__name__}: {e}"
                res["traceback"] = traceback.format_exc()[-3000:]
                if dist.get_world_size() > 1:  # a rank-local failure would leave the others in a collective
                    print(json.dumps(res), flush=True)
                    raise
        res["wall_s"] = time.time() - t0
        if rank0:
            line = json.dumps(res)
            print("SMOKE " + line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
    if rank0:
        print(f"SMOKE-DONE {len(names)} examples in {time.time() - t_all:.1f}s", flush=True)
        trainer.rewards.close() if getattr(trainer, "rewards", None) else None
        if trainer.engine is not None:
            trainer.loop.run_until_complete(trainer.engine.close())
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
