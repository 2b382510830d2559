"""``megarl proxy replay DUMP [--model HF_DIR]``: run a dumped trainer step again and judge it.

The step's optimizer steps (``learner.train_step`` on the exact dumped batches, micro-batch counts,
normalisers, objective state and learning rates) run on the Megatron learner holding ``--model``:
the dump's own pre-step weights by default, or a proxy pruned from them (fewer routed experts,
everything else the same shape). The step's injections are applied again (``--no-inject``: not;
batch poison goes back onto the dump's clean batch, see megarl.proxy.replay_batches), and the same
detectors judge the result against the run's baselines as they were before the step.

Compatibility is checked before any work (vocabulary, layers, hidden size, heads, head dim, dense
vs MoE; recorded routes need the same experts). On the dumped model, with the dump's thread count
and layout, the first optimizer step's loss and grad norm equal the recorded ones bit for bit.
When the full learner state before the step is at hand (the dump's ``learner/``, written for
``dump_steps``, or the run checkpoint of the previous step) it is loaded instead of the HF
weights, and every optimizer step of the trainer step replays exactly; otherwise later optimizer
steps start from a fresh Adam state and are comparable, not identical.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from pathlib import Path

import torch

from megarl.faults.dump import DumpError, check_compatible, default_weights, read_dump
from megarl.proxy.replay_batches import prepare_batches


def _num(x) -> float:
    """A recorded metric (float, or 'nan'/'inf' strings from dump.json) as a float."""
    return float(x) if x is not None else float("nan")


def same_value(a: float, b: float) -> bool:
    """Bitwise-equal floats, NaN equal to NaN."""
    return (math.isnan(a) and math.isnan(b)) or a == b


def check_dump_and_model(
    dump_dir: str, model_dir: str | None
) -> tuple[dict, list[dict], dict, str, dict, list[str]]:
    """Read the dump and the model config and check they fit; no process group, no model yet."""
    from megarl.learner.model import load_hf_config

    meta, batches, state = read_dump(dump_dir)
    model = model_dir or default_weights(dump_dir, meta)
    if model is None:
        raise DumpError(
            f"dump {dump_dir} holds no weights; give --model (an HF checkpoint of the weights "
            f"before step {meta['step']}, e.g. converted from {meta.get('checkpoint_before')})"
        )
    if not (Path(model) / "config.json").is_file():
        raise DumpError(f"--model {model}: no config.json (not a HF checkpoint directory)")
    hf = load_hf_config(model)
    uses_routes = any(b["batch"].routed_experts is not None for b in batches)
    notes = check_compatible(meta["model"], hf, model, uses_routes)
    vocab = int(hf["vocab_size"])
    for i, b in enumerate(batches):
        top = int(b["batch"].tokens.max()) if b["batch"].num_tokens else 0
        if top >= vocab:
            raise DumpError(f"dump batch {i} holds token id {top} >= vocab_size {vocab} of {model}")
    return meta, batches, state, model, hf, notes


# small tensors every training step updates (norm weights): equal in a model and the dump's weights
# only if that model's backbone was taken from them
_BACKBONE_PROBES = ("model.norm.weight", "model.layers.0.input_layernorm.weight")


def _probe(model_dir: str, name: str) -> torch.Tensor | None:
    from safetensors import safe_open

    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            if name in fh.keys():
                return fh.get_tensor(name)
    return None


def backbone_note(dump_dir: str, meta: dict, model_dir: str) -> str | None:
    """A note when ``model_dir``'s backbone is not the dump's pre-step weights (a proxy pruned from
    another checkpoint): the spike detectors then judge another model against the run's baselines."""
    own = default_weights(dump_dir, meta)
    if own is None or Path(own).resolve() == Path(model_dir).resolve():
        return None
    for name in _BACKBONE_PROBES:
        a, b = _probe(own, name), _probe(model_dir, name)
        if a is not None and b is not None and (a.shape != b.shape or not torch.equal(a, b)):
            return (
                f"{model_dir} does not hold the dump's pre-step backbone ({name} differs): it was not "
                "pruned from the dump's weights, so its grad norm and loss are judged against the run's "
                "baselines of another model and a spike may come from the weights, not the fault; prune "
                f"from {own}, or compare with a --no-inject replay on the same model"
            )
    return None


def replay_lr(recorded_lr: float, recorded: list, step: int, inject: bool) -> float:
    """The learning rate a replayed optimizer step uses: the recorded one, which holds the step's
    ``lr`` spike; without re-injection, the scheduled rate under it (recorded / the spike's scale)."""
    if inject:
        return recorded_lr
    return recorded_lr / math.prod(s.scale for s in recorded if s.kind == "lr" and s.step == step)


def full_state_dir(dump_dir: str, meta: dict) -> str | None:
    """The learner checkpoint holding the state before the dumped step: the dump's own
    ``learner/``, else the run checkpoint of the previous step if it still exists."""
    own = Path(dump_dir) / str(meta.get("learner_state") or "")
    if meta.get("learner_state") and own.is_dir():
        return str(own)
    prev = meta.get("checkpoint_before")
    if prev and (Path(prev) / "learner").is_dir():
        return str(Path(prev) / "learner")
    return None


def replay_dump(
    dump_dir: str, model_dir: str | None = None, inject: bool = True, old_logprobs: str = "auto"
) -> dict:
    """Replay the dump's optimizer steps on ``model_dir`` (default: the dump's weights); returns
    the report (recorded vs replayed metrics per optimizer step, events of both).

    ``old_logprobs``: 'dump' keeps the batch's old logprobs (the original policy's); 'recompute'
    replaces them with the replay model's own (forward only, before any update), so a proxy trains
    on-policy as the original did, and shifts the rollout logprobs by the same amount per token (the
    run's engine-vs-learner difference is kept, e.g. an engine precision fault); 'auto' recomputes
    when the expert count differs from the dump's.
    """
    from megarl.catalogue import load_builtin
    from megarl.faults.config import DetectorConfig
    from megarl.faults.detectors import DetectorSuite, router_load_stats
    from megarl.faults.guard import NonFiniteGuard
    from megarl.faults.injection import InjectionError, Injector, injection_from_dict
    from megarl.faults.router_stats import RouterLoadCounter
    from megarl.learner.factory import build_learner
    from megarl.learner.optim_config import OptimConfig
    from megarl.learner.parallel import ParallelLayout, initialize_parallel
    from megarl.objectives.rl_objective import build_objective

    meta, batches, state, model, hf, notes = check_dump_and_model(dump_dir, model_dir)
    if model_dir is not None and (note := backbone_note(dump_dir, meta, model_dir)):
        notes.append(note)
    if old_logprobs not in ("auto", "dump", "recompute"):
        raise DumpError(f"old_logprobs={old_logprobs!r}; allowed: auto, dump, recompute")
    step = int(meta["step"])
    torch.set_num_threads(int(meta.get("torch_threads") or torch.get_num_threads()))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    lay = meta["layout"]
    same_layout = world == lay["world_size"]
    if same_layout:
        layout = ParallelLayout(
            tp=lay["tp"],
            pp=lay["pp"],
            ep=lay["ep"],
            cp=lay["cp"],
            sequence_parallel=lay["sequence_parallel"],
            expert_tp=lay["expert_tp"],
        )
    else:
        layout = ParallelLayout()
        notes.append(
            f"the dump ran on {lay['world_size']} rank(s) (tp={lay['tp']}, pp={lay['pp']}, ep={lay['ep']}, "
            f"dp={lay.get('dp', 1)}); this replay on {world}: comparable numbers, not bit-exact ones"
        )
    run_cfg = meta["run_config"]
    load_builtin()  # the dumped run's method parts (objective parts register when their family loads)
    model_cfg = run_cfg["model"]
    groups = initialize_parallel(layout, seed=model_cfg["seed"])
    learner = build_learner(
        hf, groups, OptimConfig(**run_cfg["optimizer"]), model_cfg["params_dtype"], model_cfg["seed"]
    )
    full = full_state_dir(dump_dir, meta) if model_dir is None else None
    if full is not None:
        from megarl.learner.dist_checkpoint import load_checkpoint

        load_checkpoint(learner, full)
        notes.append(f"full learner state before the step (weights, Adam moments, LR schedule) from {full}")
    else:
        learner.load_hf(model)
    learner.step = int(state["learner_step"])
    objective = build_objective(run_cfg["objective"])
    objective.load_state_dict(state["objective_state"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])

    dcfg = DetectorConfig(**meta["run_config"]["faults"]["detectors"])
    suite = DetectorSuite(dcfg)
    if state.get("detectors"):
        suite.load_state_dict(state["detectors"])
    guard = NonFiniteGuard(learner).install() if dcfg.skip_nonfinite else None
    recorded = [injection_from_dict(d, "dump injections") for d in meta.get("injections", [])]
    if inject and model_dir is not None:
        from megarl.proxy.expert_map import ExpertMapError, map_expert_injections

        try:
            recorded, mapped = map_expert_injections(recorded, model)
        except ExpertMapError as e:
            raise DumpError(f"the dump's injection cannot be applied on {model}: {e}") from None
        notes += mapped
    try:
        injector = Injector(
            learner.model,
            recorded if inject else [],
            groups.device.type,
            learner.spec.vocab_size,
            optimizer=learner.optimizer,
        )
    except InjectionError as e:
        # e.g. a fault in a routed expert the proxy pruned away: say so instead of replaying without it
        raise DumpError(
            f"the dump's injection cannot be applied on {model} ({e}); replay on a model that "
            "has that module or parameter, or with --no-inject"
        ) from None
    spec = learner.spec
    router = RouterLoadCounter(learner.model, spec.moe_layers, spec.num_experts) if spec.is_moe else None
    if router is not None:
        router.start()
    prep = prepare_batches(
        batches,
        learner,
        injector if inject else None,
        step,
        groups,
        recorded,
        old_logprobs,
        proxy=int(meta["model"]["num_experts"]) != learner.spec.num_experts,
    )
    notes += prep["notes"]
    replayed, armed = [], []
    for i, b in enumerate(batches):
        recorded_lr = (
            (meta["optimizer_steps"][i] or {}).get("lr") if i < len(meta["optimizer_steps"]) else None
        )
        if recorded_lr is not None:
            for g in learner.optimizer.param_groups:
                g["lr"] = replay_lr(float(recorded_lr), recorded, step, inject)
        armed += [s.kind for s in injector.arm(step, apply_lr=recorded_lr is None) if s.kind not in armed]
        try:
            m = learner.train_step(b["batch"], objective, b["num_micro_batches"], b["normalisers"])
        finally:
            injector.disarm()
        replayed.append(m)
    if guard is not None:
        guard.uninstall()
    rec: dict = {f"train/{k}": sum(m[k] for m in replayed) / len(replayed) for k in replayed[-1]}
    if "train_rollout_logprob_gap" in replayed[0]:
        rec["faults/logprob_gap_first"] = replayed[0]["train_rollout_logprob_gap"]
    lp = [
        (b["batch"].old_logprobs, b["batch"].rollout_logprobs, b["batch"].loss_mask.bool()) for b in batches
    ]
    if all(o is not None and r is not None for o, r, _ in lp):
        rec["rollout/logprob_gap_old"] = float(torch.cat([(o[m] - r[m]).abs() for o, r, m in lp]).mean())
    counts = None
    if router is not None:
        router.stop()
        counts = router.collect()
        st = router_load_stats(counts)
        for i, layer in enumerate(spec.moe_layers):
            rec[f"router/layer{layer}/imbalance"] = float(st["imbalance"][i])
            rec[f"router/layer{layer}/load_entropy"] = float(st["entropy"][i])
    events = suite.check(step, rec, counts, spec.moe_layers)
    opt = []
    for i, m in enumerate(replayed):
        r = meta["optimizer_steps"][i] if i < len(meta["optimizer_steps"]) else {}
        row = {
            "recorded": {k: _num(r.get(k)) for k in ("loss", "grad_norm")},
            "replayed": {k: float(m[k]) for k in ("loss", "grad_norm")},
        }
        row["exact"] = all(same_value(row["recorded"][k], row["replayed"][k]) for k in ("loss", "grad_norm"))
        opt.append(row)
    rec_types = sorted({e["type"] for e in meta.get("events", [])})
    got_types = sorted({e["type"] for e in events})
    return {
        "dump": str(dump_dir),
        "step": step,
        "model": model,
        "notes": notes,
        # what this replay applied itself, and what it found already in the dumped batch
        "injections": sorted(set(armed) | ({"poison"} if prep["poison"] else set())),
        "injections_in_batch": ["poison"] if prep["in_batch"] else [],
        "optimizer_steps": opt,
        "record": rec,
        "events": events,
        "recorded_events": meta.get("events", []),
        "same_event_types": rec_types == got_types,
        "recorded_model": meta["model"],
    }


def format_report(rep: dict) -> str:
    """The replay report as text lines (what the CLI prints)."""
    lines = [f"replay of step {rep['step']} from {rep['dump']} on {rep['model']}"]
    lines += [f"  note: {n}" for n in rep["notes"]]
    if rep["injections"]:
        lines.append(f"  injections re-applied: {', '.join(rep['injections'])}")
    if rep.get("injections_in_batch"):
        lines.append(
            f"  already in the dumped batch (used as dumped): {', '.join(rep['injections_in_batch'])}"
        )
    for i, o in enumerate(rep["optimizer_steps"]):
        r, p = o["recorded"], o["replayed"]
        lines.append(
            f"  optimizer step {i + 1}: loss {p['loss']!r} (recorded {r['loss']!r})  grad_norm "
            f"{p['grad_norm']!r} (recorded {r['grad_norm']!r})  {'EXACT' if o['exact'] else 'differs'}"
        )
    rec = sorted({e["type"] for e in rep["recorded_events"]})
    got = sorted({e["type"] for e in rep["events"]})
    lines.append(
        f"  events recorded: {', '.join(rec) or 'none'}; replayed: {', '.join(got) or 'none'}"
        f"  ({'same types' if rep['same_event_types'] else 'DIFFERENT types'})"
    )
    # each event type with its numbers, replayed and recorded, so a match of types is not all one sees
    by_type = {t: [e for e in rep["events"] if e["type"] == t] for t in got}
    was = {t: [e for e in rep["recorded_events"] if e["type"] == t] for t in rec}
    for t in sorted(set(got) | set(rec)):
        mine = json.dumps([e["detail"] for e in by_type.get(t, [])] or "none", default=str)
        theirs = json.dumps([e["detail"] for e in was.get(t, [])] or "none", default=str)
        lines.append(f"    {t}: replayed {mine.strip('[]')}")
        lines.append(f"    {' ' * len(t)}  recorded {theirs.strip('[]')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``megarl proxy replay DUMP [--model HF_DIR] [--no-inject] [--old-logprobs auto|dump|recompute]
    [--out report.json]``."""
    ap = argparse.ArgumentParser(
        prog="megarl proxy replay",
        description="Re-run a dumped trainer step (run_dir/dumps/step_N) on the original "
        "weights or a proxy, and report loss, grad norm and the detectors.",
    )
    ap.add_argument("dump", help="a step dump directory (run_dir/dumps/step_NNNNNN)")
    ap.add_argument(
        "--model",
        default=None,
        help="HF checkpoint to replay on (default: the dump's own "
        "pre-step weights); a proxy pruned from them works too",
    )
    ap.add_argument("--no-inject", action="store_true", help="do not re-apply the step's injected faults")
    ap.add_argument(
        "--old-logprobs",
        default="auto",
        choices=["auto", "dump", "recompute"],
        help="old logprobs of the PPO ratio: the dumped ones, or recomputed by the replay model "
        "(auto: recompute when the expert count differs, i.e. on a proxy)",
    )
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    try:
        check_dump_and_model(args.dump, args.model)
    except DumpError as e:
        print(f"megarl proxy replay: {e}", file=sys.stderr)
        return 2
    try:
        rep = replay_dump(args.dump, args.model, inject=not args.no_inject, old_logprobs=args.old_logprobs)
    except DumpError as e:
        print(f"megarl proxy replay: {e}", file=sys.stderr)
        return 2
    print(format_report(rep), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rep, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
