"""Every examples/methods/*.yaml for a few RL steps in ONE trainer process group (one model type).

    python tests/trainer/method_smoke.py --model dense --out results.jsonl [--only gepo,eppo] [--async gigpo]
    torchrun --nproc-per-node 2 tests/trainer/method_smoke.py --model moe --out results.jsonl

Every example names ``base: ../quickstart.yaml`` (a layered config,
megarl/trainer/config_layers.py); here its base is the quickstart of ``--model``
(examples/quickstart.yaml or examples/quickstart-moe.yaml), shrunk, and the example is laid over it
with the loader's own ``merge_layers``, so each example runs as ``megarl train`` would read it. The
expensive parts are shared by all examples: process group, parallel layout, data, the embedded
engine and the initial policy (a short supervised warm-up, written once). Per example the real
trainer code builds what a run builds (``Run.build_learners``: a fresh learner and optimizer holding
the initial policy, the learner-side method parts, the objective; ``Run.build_rank0_parts``: the
round processors and the rollout collector), resets the engine to the initial weights and the
sampler, and runs ``Trainer.step`` ``--steps`` times.

Per example, rank 0 prints (and appends to ``--out``) one JSON line: the metrics of every step,
the largest parameter change (max over ranks), the method's checkpoint state after a save/load
round trip, and ``error`` when the example failed (the loop goes on with the next one).

Examples run through the synchronous loop (``async_loop.enabled: false`` laid over each);
``--async NAMES`` (or ``all``) then runs those examples again through the asynchronous loop
(``async_loop.enabled: true, max_staleness: 1``; their lines say ``"loop": "async"``), in the
same process after the synchronous ones: the trainer's own ``AsyncTrainer.make_source`` builds
each one's engine, event-loop thread and rollout producer, stopped and closed after its steps as
``Trainer.finish`` does; the session's shared engine then serves on.

The distillation examples' teacher is trained once per session (``_setup``:
megarl.testing.teacher.fit_teacher, a short supervised fit on the training answers) in the MoE
quickstart's architecture (a Mixture-of-Experts teacher for the dense student too). Its held-out
answer NLL and the initial policy's go into every result line (``teacher``), so the test can check
that the teacher knows the task better than its student.
The smoke base adds one reward dimension to the quickstart's exact match (``format``: the response
is digits only, weight 0.5), so that two steps of a barely warmed-up model see non-zero
advantages; examples with their own ``reward.functions`` keep theirs.
"""

from __future__ import annotations

import argparse
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
PLUGINS = ROOT / "examples" / "plugins"  # third-party methods (their modules are imported from here)
QUICKSTART = {
    "dense": ROOT / "examples" / "quickstart.yaml",
    "moe": ROOT / "examples" / "quickstart-moe.yaml",
}

# Examples the trainer cannot run yet, with the reason (the pytest side reports them as skipped).
UNSUPPORTED: dict[str, str] = {}

TEACHER_STEPS = 40  # SFT steps of the session's teacher (the student's warm-up has 6)

FORMAT_REWARD = {"name": "format", "kind": "regex", "pattern": r"^\d+$", "weight": 0.5}

# per-example settings laid over the example for the short smoke run
SMOKE_OVERRIDES: dict[str, dict] = {
    # one critic warm-up step, then a policy update: both phases within the smoke's 2 steps
    "bpco": {"inputs": {"values": {"warmup_steps": 1}}},
    "bpco-privileged": {"inputs": {"values": {"warmup_steps": 1}}},
    # a small population with raw rewards: 4 smoke prompts rarely tell z-scored members apart
    "es": {"method": {"population": 1, "sigma": 0.02, "antithetic": False, "normalise": "none"}},
    # the barely warmed smoke policy has no correct sibling and no majority answer: give the
    # self-teacher a context so that its forward runs in the smoke's 2 steps
    "sc-grpo": {"inputs": {"self_teacher_context": {"source": "answer"}}},
    "crpo": {"inputs": {"self_teacher_context": {"source": "answer"}}},
    "uopsd": {"inputs": {"self_teacher_context": {"min_vote": 0.0, "solutions": 2}}},  # a 2-solution mixture
    "sc-grpo-vocab": {"inputs": {"self_teacher_context": {"source": "answer"}}},
    "uopsd-vocab": {"inputs": {"self_teacher_context": {"min_vote": 0.0}}},
    # the smoke policy reads no card correctly in 2 steps: a negative margin opens SKALD's
    # teacher-advantage gate, so that the tilted term toward the card-reading self-teacher trains
    # SKALD measures its external teacher's accuracy per prompt (sampled from the teacher)
    "skald": {"method": {"teacher_samples": 2}},
    "skald-cards": {
        "objective": {
            "regularisers": [{"name": "skald_self", "coef": 1.0, "gate": "teacher_advantage", "margin": -0.5}]
        }
    },
    # the smoke policy is never correct in 2 steps: Agon grades with the weighted reward (format too)
    "agon": {"method": {"verdict": "reward"}},
    # the flow models (Megatron DiTs, MoE under EP=2): a narrower DiT and a short flow-matching fit
    "lc-grpo": {
        "method": {"pretrain_steps": 2, "groups": 2, "group_size": 4, "steps": 4, "hidden": 16, "heads": 2}
    },
    "flowcts": {
        "method": {
            "pretrain_steps": 2,
            "reference_pretrain_steps": 2,
            "batch": 16,
            "steps": 4,
            "hidden": 16,
            "heads": 2,
        }
    },
    # room for the 4 groups of the smoke's 2 mini-batches x 2 replicas after abandoned prompts
    "sara": {"method": {"budget_samples": 64}},
    # more of each prompt's 4 prefixes kept: groups of >= 2 for the 2 mini-batches x 2 replicas
    "pair": {"method": {"budget_frac": 0.75}},
    # the smoke data has 64 rows: select 32, with short autoencoder training
    "mass": {"method": {"budget": 32, "steps": 20}},
    # the smoke policy is never correct in 2 steps: TASPO's bank counts the format check as the
    # verification, so that step 1's successes are step 2's privileged information
    "taspo": {
        "reward": {
            "functions": [{"name": "correct", "kind": "exact_match"}, {**FORMAT_REWARD, "correct": True}]
        }
    },
    # one sample per prompt: the smoke's 16 samples per step (4 prompts x 4), not the example's 64
    "comppo": {"schedule": {"prompts_per_step": 16}},
    "sapo": {"schedule": {"prompts_per_step": 16}},
    # the smoke's run directory is shared: replay what examples/methods/regen.yaml (run before it) wrote
    "regen-replay": {"method": {"replay_in": "replay"}},
}


# laid over an example: its pass through the synchronous loop, and through the asynchronous one (``--async``)
LOOPS = {
    "sync": {"async_loop": {"enabled": False}},
    "async": {"async_loop": {"enabled": True, "max_staleness": 1}},
}


def example_names() -> list[str]:
    """Every example file's stem (methods and plugins), sorted."""
    return sorted(p.stem for d in (EXAMPLES, PLUGINS) for p in d.glob("*.yaml"))


def example_path(name: str) -> Path:
    """The example file of ``name`` (examples/methods or examples/plugins)."""
    p = EXAMPLES / f"{name}.yaml"
    return p if p.exists() else PLUGINS / f"{name}.yaml"


def base_config(model: str, work: Path, steps: int) -> dict:
    """The quickstart config of ``model``, shrunk to a smoke run under ``work``."""
    from megarl.trainer.config_layers import merge_layers, read_layered_config

    d = read_layered_config(QUICKSTART[model])
    return merge_layers(
        d,
        {
            "data": {
                "train": str(work / "train.jsonl"),
                "eval": str(work / "eval.jsonl"),
                "generate": {"num_train": 64, "num_eval": 4},
            },
            "reward": {
                "functions": [dict(f, correct=True) for f in d["reward"]["functions"]] + [FORMAT_REWARD]
            },
            "warmup": {"sft_steps": 6, "batch_size": 32},
            "rollout": {"n": 4, "max_new_tokens": 6},
            # 2 mini-batches: the second optimizer step is off-policy, so clipping, trust regions and
            # corrections act (with one, every ratio is 1 and most losses coincide)
            "schedule": {
                "steps": steps,
                "prompts_per_step": 4,
                "mini_batches": 2,
                "micro_batches": 1,
                "eval_every": 0,
                "eval_samples": 4,
                "eval_k": 1,
            },
            "optimizer": {"lr_warmup_steps": 0},  # both steps update the weights
            "checkpoint": {"every": 1000},
            "inputs": {"rrpo_scores": {"anchors": 2, "head_steps": 5}},
            "teacher": {"hf_dir": str(work / "teacher")},  # written by _setup (on-policy distillation)
            "logging": {"run_dir": str(work / "run"), "plot": False},
        },
    )


def example_config(base: dict, name: str) -> dict:
    """The example laid over ``base`` (the smoke quickstart) in place of its own ``base:`` file."""
    from megarl.trainer.config_layers import merge_layers

    path = example_path(name)
    ex = yaml.safe_load(path.read_text()) or {}
    if ex.pop("base", None) != "../quickstart.yaml":
        raise ValueError(
            f"{path}: an example must name base: ../quickstart.yaml (its smoke base replaces it)"
        )
    d = merge_layers(merge_layers(base, ex), SMOKE_OVERRIDES.get(name, {}))
    d["logging"] = base["logging"]  # the smoke's run directory, not the example's runs/NAME
    d["reward"].setdefault("judge", {}).setdefault("max_new_tokens", 4)
    return d


def _params(run) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.learner.model.parameters()]


def _max_change(before: list[torch.Tensor], run) -> float:
    d = max(
        (float((p.detach() - b).abs().max()) for p, b in zip(run.learner.model.parameters(), before)),
        default=0.0,
    )
    t = torch.tensor([d], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _state_summary(run) -> dict:
    """The method state a checkpoint would hold, after a torch.save/load round trip, restored into
    freshly built parts (the resume path); returns its keys per part (round processors named by
    what they are: the reward shaper, RRPO's scorer)."""
    import dataclasses

    from megarl.objectives.rl_objective import build_objective
    from megarl.trainer.method_runtime import MethodRuntime

    obj = _roundtrip(run.objective.state_dict())
    build_objective(run.cfg.objective).load_state_dict(obj)
    meth = _roundtrip(run.method.state_dict())
    ctx = dataclasses.replace(run.context(run.engine), make_learner=lambda *a, **k: None, policy=None)
    fresh = MethodRuntime.build_learner_side(ctx, run.spec)
    fresh.build_rank0_side(ctx, run.spec, run.method_knobs)
    fresh.load_state_dict(meth, rank0=dist.get_rank() == 0)
    fresh.close()  # parts holding resources (clients, an engine's decode loop) let them go
    summary = {"inputs": ["estimator"] if meth["estimator"] is not None else []}
    names = {"ShapingProcessor": "shaping", "RRPOScorer": "rrpo"}
    for proc, st in zip(run.method.round_processors, meth["round_processors"]):
        summary[names.get(type(proc).__name__, type(proc).__name__)] = sorted(st)
    if meth["step_hooks"]:
        summary["step_hooks"] = [sorted(h) for h in meth["step_hooks"]]
    if "allocator" in meth:  # restored above into the fresh run's allocator
        summary["allocator"] = sorted(meth["allocator"])
    return {"objective": sorted(obj), "method": summary}


def _setup(run, model: str) -> Path:
    """Everything the examples share: process group, layout, data, initial policy, engine."""
    from megarl.learner.parallel import ParallelLayout, init_distributed, initialize_parallel
    from megarl.plugin.teacher_config import teacher_config
    from megarl.rundir import INIT_POLICY
    from megarl.trainer.config import check_layout
    from megarl.trainer.setup import load_datasets, tokenizer_and_hf_config
    from megarl.trainer.warmup import run_warmup

    cfg = run.cfg
    run.tok, run.hf = tokenizer_and_hf_config(cfg)
    check_layout(cfg, run.hf, int(os.environ.get("WORLD_SIZE", "1")))
    init_distributed()
    run.rank0 = dist.get_rank() == 0
    # rank 0 writes the dataset first (the other ranks read it)
    if run.rank0:
        run.train_ds, run.eval_ds = load_datasets(cfg, run.tok)
    dist.barrier()
    if not run.rank0:
        run.train_ds, run.eval_ds = load_datasets(cfg, run.tok)
    p = cfg.parallel
    run.groups = initialize_parallel(
        ParallelLayout(
            tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp, sequence_parallel=p.sequence_parallel, expert_tp=p.expert_tp
        ),
        seed=cfg.model.seed,
    )
    run.failures_total = {"errors": 0, "timeouts": 0}
    run.rewards = None
    init_dir = run.run_dir / INIT_POLICY
    if run.rank0:
        run.run_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    run_warmup(run, init_dir)
    run.teacher_info = _fit_teacher(run, model, Path(teacher_config(cfg).hf_dir), init_dir)
    dist.barrier()
    run.build_engine()
    return init_dir


def _teacher_hf(run, model: str) -> dict:
    """The teacher's architecture: the MoE quickstart's model, with the policy's vocabulary and
    special token ids (a MoE teacher for the dense student; the MoE run's EP=2 layout cannot hold a
    dense model, whose learner refuses expert parallelism)."""
    from megarl.trainer.config_layers import read_layered_config

    other = read_layered_config(QUICKSTART["moe"])["model"]["hf_config"]
    keep = ("vocab_size", "eos_token_id", "pad_token_id", "bos_token_id")
    return {**other, **{k: run.hf[k] for k in keep if k in run.hf}}


def _fit_teacher(run, model: str, out: Path, init_dir: Path) -> dict:
    """A trained teacher (megarl.testing.teacher.fit_teacher), once per session (collective);
    returns its held-out answer NLL beside the initial policy's."""
    from megarl.testing.teacher import answer_nll, fit_teacher

    info = fit_teacher(run, out, _teacher_hf(run, model), steps=TEACHER_STEPS)
    student = run.make_learner(run.hf, trainable=False)
    student.load_hf(str(init_dir))
    info["student_eval_nll"] = answer_nll(student, run.tok, list(run.eval_ds.rows))
    del student
    return info


def _kept(v) -> bool:
    """A metric value the result line keeps: a number, a string or a histogram (``async/versions``)."""
    if isinstance(v, dict):
        return all(isinstance(x, (int, float)) for x in v.values())
    return isinstance(v, (int, float, str))


def _close_own_source(run, source, shared: tuple) -> None:
    """Stop an example's own rollout source (producer), close its engine and event loop, as
    ``Trainer.finish`` does; the session's shared engine and loop serve the next example."""
    try:
        if source is not None:
            source.close()
        if run.engine is not None and run.engine is not shared[0]:
            run.loop.run_until_complete(run.engine.close())
    finally:
        if run.loop is not shared[1]:
            run.loop.close()
        run.engine, run.loop = shared
        vars(run).pop("make_event_loop", None)  # the source's own loop factory, if it set one


def run_example(run, name: str, cfg, init_dir: Path, steps: int) -> dict:
    """Build the example's parts with the trainer's own code and run ``steps`` steps (through the
    asynchronous loop when ``cfg.async_loop.enabled``: its own source, engine and producer)."""
    from megarl.data.dataset import PromptSampler
    from megarl.rewards.compute import RewardComputer
    from megarl.trainer.config import method_knobs, method_of
    from megarl.trainer.loop import SyncRollouts, trainer_class

    if run.rank0 and run.rewards is not None:
        run.rewards.close()
    run.cfg = cfg
    run.rewards = RewardComputer(cfg.reward) if run.rank0 else None
    run.sampler = PromptSampler(len(run.train_ds), cfg.schedule.seed)
    run.spec = method_of(cfg)
    run.method_knobs = method_knobs(cfg, run.spec)
    run.build_learners(init_dir)
    run.build_faults()
    trainer = trainer_class(cfg)(cfg)
    trainer.r, trainer.source = run, None
    own, shared = cfg.async_loop.enabled, (run.engine, run.loop)
    try:
        if own:  # engine, event-loop thread, producer and collector, as the asynchronous run builds them
            trainer.source = trainer.make_source(run, 0)
        else:  # the shared engine
            run.build_rank0_parts()
            trainer.source = SyncRollouts(run)
        trainer.source.update_weights(0)  # the engine back to the initial policy
        before = _params(run)
        recs = []
        for s in range(1, steps + 1):
            t0 = time.time()
            rec = trainer.step(s)
            rec["wall_s"] = time.time() - t0
            recs.append({k: v for k, v in rec.items() if _kept(v)})
        trainer.source.close()  # no batch is produced while the state is read
        state = _state_summary(run)
        run.method.close()  # as Trainer.finish does: the shared engine goes on to the next example as it was
    finally:
        if own:
            _close_own_source(run, trainer.source, shared)
    return {"steps": recs, "param_change": _max_change(before, run), "state": state}


def main(argv: list[str] | None = None) -> int:
    """Run the examples; one JSON line per example on rank 0."""
    from megarl.trainer.config import apply_overrides, from_dict
    from megarl.trainer.config_layers import merge_layers
    from megarl.trainer.run import Run

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(QUICKSTART), default="dense")
    ap.add_argument("--work", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--out", default=None, help="append the JSON lines here too")
    ap.add_argument("--only", default="", help="comma-separated example names (default: all)")
    ap.add_argument(
        "--async",
        dest="async_names",
        default="",
        help="comma-separated examples (or 'all') run again through the asynchronous loop, after the rest",
    )
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override of the smoke base config (section.key=value), repeatable",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("MEGARL_NUM_THREADS", "1")))
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="megarl-smoke-"))
    base = apply_overrides(base_config(args.model, work, args.steps), args.set)
    names = [n for n in (args.only.split(",") if args.only else example_names()) if n]
    async_names = [n for n in args.async_names.split(",") if n]
    async_names = example_names() if async_names == ["all"] else async_names
    t_all = time.time()
    run = Run(from_dict(base))
    init_dir = _setup(run, args.model)
    rank0 = dist.get_rank() == 0
    for name, loop in [(n, "sync") for n in names] + [(n, "async") for n in async_names]:
        t0 = time.time()
        res: dict = {"example": name, "model": args.model, "loop": loop}
        if name in UNSUPPORTED:
            res["unsupported"] = UNSUPPORTED[name]
        else:
            try:
                cfg = from_dict(merge_layers(example_config(base, name), LOOPS[loop]))
                res.update(run_example(run, name, cfg, init_dir, args.steps))
            except Exception as e:  # reported per example; the pytest side fails that example
                res["error"] = f"{type(e).__name__}: {e}"
                res["traceback"] = traceback.format_exc()[-3000:]
                if dist.get_world_size() > 1:  # a rank-local failure would leave the others in a collective
                    print(json.dumps(res), flush=True)
                    raise
        res["wall_s"] = time.time() - t0
        res["teacher"] = run.teacher_info
        if rank0:
            line = json.dumps(res)
            print("SMOKE " + line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
    if rank0:
        total = len(names) + len(async_names)
        print(f"SMOKE-DONE {total} examples in {time.time() - t_all:.1f}s", flush=True)
        if run.rewards is not None:
            run.rewards.close()
        if run.engine is not None:
            run.loop.run_until_complete(run.engine.close())
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(PLUGINS))
    sys.exit(main())
