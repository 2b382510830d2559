"""End-to-end RL step speed on CPU: ``megarl train`` against a plain PyTorch/transformers GRPO loop.

    .venv/bin/python benchmarks/step_speed.py                 # 20 steps each, one torch thread
    .venv/bin/python benchmarks/step_speed.py --steps 40 --megarl-arg schedule.old_logprobs=rollout

The task: a ~1M-parameter Qwen3 (4 layers, hidden 128, 4 heads / 2 KV heads, character tokenizer,
vocabulary 24) with random weights on the quickstart's reverse-a-3-digit-string prompts; GRPO with
16 prompts x 8 samples, at most 4 new tokens, temperature 1, lr 1e-4, no KL, token-mean loss, clip
0.2, one optimizer step per batch, no supervised warm-up. megarl runs ``examples/quickstart.yaml``
with those keys overridden (embedded engine, learner on gloo, world size 1).

The baseline, measured in the same invocation, is the smallest loop that does the same work: one
transformers model, ``generate`` of the 16 x 8 samples, one forward for the new log-probs (the old
ones are the same numbers detached: the update is on-policy), the clipped loss, backward, AdamW.
It is what a single-process trainer such as TRL's GRPOTrainer does, without a framework around it.

Each side is its own process (``os.wait4`` gives its CPU time, peak RSS and context switches,
children included). Printed: median s/step over the steps after the first, CPU seconds per step
(megarl: the process's CPU time between its records of step 1 and step N-1; the baseline: its own
``time.process_time`` per step; less sensitive to a shared machine's load than wall time), CPU
seconds and voluntary context switches of the whole process, peak RSS, megarl's logged phase
times (``time/rollout``, ``time/logprob``, ``time/train``, ``time/sync``), the threads of the megarl
process that made the most voluntary context switches, and megarl / baseline ratios.

Then, in a third process, the train step on its own: megarl's ``Learner.train_step`` (the learner,
objective and non-finite guard the run builds) against a plain PyTorch forward + backward + gradient
clipping + AdamW of the same model (transformers' Qwen3 holding the learner's weights) on the same
packed batch of 16 x 8 GRPO sequences (the prompts of one step, random responses of 1-4 tokens, EOS
where shorter, group-normalised random rewards), the two interleaved step by step; printed: the
median thread CPU and wall milliseconds per step of each side and megarl / plain, and the two sides'
losses at the first step (the same model on the same batch: they agree to float round-off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("time/rollout", "time/reward", "time/logprob", "time/train", "time/sync", "time/step")
HF_CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
PROMPTS, N, MAX_NEW, LR, CLIP = 16, 8, 4, 1e-4, 0.2


def megarl_overrides(steps: int, run_dir: str) -> list[str]:
    """``megarl train`` overrides that turn the quickstart into this benchmark's task."""
    return [
        "model.hf_config.num_hidden_layers=4",
        f"rollout.max_new_tokens={MAX_NEW}",
        f"rollout.n={N}",
        "warmup.sft_steps=0",
        "objective.kl_coef=0.0",
        "objective.aggregation=token-mean",
        f"objective.clip_low={CLIP}",
        f"objective.clip_high={CLIP}",
        f"optimizer.lr={LR}",
        "optimizer.lr_warmup_steps=0",
        f"schedule.steps={steps}",
        f"schedule.prompts_per_step={PROMPTS}",
        "schedule.eval_every=0",
        "schedule.eval_samples=16",
        "checkpoint.every=100000",
        "checkpoint.resume=never",
        "checkpoint.on_existing=overwrite",
        f"logging.run_dir={run_dir}",
        "logging.plot=false",
        "logging.progress=lines",
    ]


def _cpu_s(pid: int, tid: int | None = None) -> float | None:
    """CPU seconds (user + system) of a live process (all its threads) or of one of its threads."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    """``pid`` and its live descendant processes."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return out


def _thread_switches(pid: int, seen: dict[tuple[int, int], tuple[str, int, float]]) -> None:
    """Record in ``seen`` the voluntary context switches of every thread of ``pid`` and of its
    descendants, keyed by (process, thread), with the thread's name (child processes: 'child:')."""
    for p in _descendants(pid):
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                status = Path(f"/proc/{p}/task/{tid}/status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            name = ("" if p == pid else "child:") + fields.get("Name", "?").strip()
            cpu = _cpu_s(p, int(tid)) or 0.0
            seen[(p, int(tid))] = (name, int(fields.get("voluntary_ctxt_switches", "0")), cpu)


def _by_name(seen: dict[tuple[int, int], tuple[str, int, float]]) -> dict[str, list[float]]:
    """Thread name -> [threads seen, their voluntary context switches, their CPU seconds]."""
    out: dict[str, list[float]] = {}
    for name, n, cpu in seen.values():
        slot = out.setdefault(name, [0, 0, 0.0])
        slot[0] += 1
        slot[1] += n
        slot[2] += cpu
    return out


def run_measured(cmd: list[str], env: dict, log_path: Path, steps_done=None) -> dict:
    """Run ``cmd``; its wall time, CPU seconds, peak RSS, context switches (``os.wait4``) and the
    voluntary context switches per thread name, sampled every 0.1 s while it ran (a thread's last
    sample: threads that lived less than 0.1 s are missed). ``steps_done()``, when given, counts the
    steps the process finished so far: ``marks`` then holds (steps, process CPU s) at each new count."""
    t0 = time.time()
    marks: list[tuple[int, float]] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        seen: dict[tuple[int, int], tuple[str, int, float]] = {}
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.1):
                _thread_switches(proc.pid, seen)
                n = steps_done() if steps_done else 0
                if n and (not marks or n > marks[-1][0]):
                    cpu = _cpu_s(proc.pid)
                    if cpu is not None:
                        marks.append((n, cpu))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        _, status, ru = os.wait4(proc.pid, 0)
        done.set()
        watcher.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"step_speed: {' '.join(cmd[:4])} ... exited {proc.returncode}; see {log_path}")
    return {
        "wall_s": time.time() - t0,
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "peak_rss_mib": ru.ru_maxrss / 1024,
        "vol_ctx": ru.ru_nvcsw,
        "invol_ctx": ru.ru_nivcsw,
        "threads": _by_name(seen),
        "marks": marks,
    }


def run_megarl(steps: int, threads: int, work: Path, extra: list[str]) -> dict:
    """One ``megarl train`` run of the task; process figures plus the medians of its phase times."""
    run_dir = work / "megarl_run"
    env = dict(
        os.environ, MEGARL_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT)
    )
    cmd = [sys.executable, "-m", "megarl.cli", "train", str(ROOT / "examples/quickstart.yaml")]
    metrics = run_dir / "metrics.jsonl"

    def steps_done() -> int:  # records after step 0's evaluation
        try:
            return max(0, len(metrics.read_text().splitlines()) - 1)
        except OSError:
            return 0

    res = run_measured(
        cmd + megarl_overrides(steps, str(run_dir)) + extra, env, work / "megarl.log", steps_done
    )
    # CPU per step between the records of step 1 and step N-1 (the last record includes the final
    # evaluation and checkpoint)
    inner = [(n, c) for n, c in res["marks"] if 1 <= n <= steps - 1]
    if len(inner) >= 2 and inner[-1][0] > inner[0][0]:
        res["cpu_per_step"] = (inner[-1][1] - inner[0][1]) / (inner[-1][0] - inner[0][0])
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r.get("step", 0) >= 2]  # step 1 pays one-time costs
    res["phases"] = {k: statistics.median(r[k] for r in recs if k in r) for k in PHASES}
    res["s_per_step"] = res["phases"]["time/step"]
    res["steps"] = steps
    return res


def run_baseline(steps: int, threads: int, work: Path) -> dict:
    """The plain-PyTorch GRPO loop (``--baseline-worker``) in its own process."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    out = work / "baseline.json"
    cmd = [sys.executable, __file__, "--baseline-worker", str(out), "--steps", str(steps)]
    res = run_measured(cmd + ["--threads", str(threads)], env, work / "baseline.log")
    res.update(json.loads(out.read_text()))
    return res


def plain_update(model, opt, logits, targets, adv, mask, clip_low: float, clip_high: float, max_norm: float):
    """One on-policy clipped-PPO update of a plain PyTorch loop: ``logits`` [B, R, V] of ``targets``
    [B, R] (old logprobs = the current ones, detached), token-mean over ``mask``, backward, gradient
    clipping, the optimizer's step; returns the loss."""
    import torch

    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    pg = -torch.min(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    loss = (pg * mask).sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return loss


def baseline_worker(out_path: str, steps: int, threads: int) -> None:
    """GRPO on the task with transformers + torch only; writes the per-step timings as JSON."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.data.tokenizer import CharTokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(1234)
    tok = CharTokenizer("0123456789+=RC ")
    cfg = AutoConfig.for_model(
        **{**HF_CONFIG, "vocab_size": tok.vocab_size, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id},
        bos_token_id=tok.bos_id,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    rows = [json.loads(x) for x in (ROOT / "examples/data/reverse3-train.jsonl").read_text().splitlines()]
    times: list[dict] = []
    cpu: list[float] = []
    for step in range(steps):
        batch = rows[(step * PROMPTS) % len(rows) :][:PROMPTS]
        t0, c0 = time.time(), time.process_time()
        prompts = torch.tensor([tok.encode(r["prompt"]) for r in batch])  # equal lengths: no padding
        P = prompts.shape[1]
        model.eval()
        with torch.no_grad():
            seqs = model.generate(
                prompts,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=MAX_NEW,
                num_return_sequences=N,
                pad_token_id=tok.pad_id,
            )
        t_gen = time.time() - t0
        resp = seqs[:, P:]
        done = torch.cumsum((resp == tok.eos_id).long(), 1)
        mask = ((done - (resp == tok.eos_id).long()) == 0).float()  # tokens up to and including eos
        answers = [r["answer"] for r in batch for _ in range(N)]
        rewards = torch.tensor([float(tok.decode(resp[i].tolist()) == a) for i, a in enumerate(answers)])
        g = rewards.view(PROMPTS, N)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1, 1)
        t1 = time.time()
        model.train()
        logits = model(seqs).logits[:, P - 1 : -1].float()
        plain_update(model, opt, logits, resp, adv, mask, CLIP, CLIP, 1.0)  # one on-policy update per batch
        times.append({"time/rollout": t_gen, "time/train": time.time() - t1, "time/step": time.time() - t0})
        cpu.append(time.process_time() - c0)
    later = times[1:] or times
    phases = {k: statistics.median(t[k] for t in later) for k in times[0]}
    cpu_per_step = statistics.mean(cpu[1:] or cpu)
    Path(out_path).write_text(
        json.dumps(
            {
                "phases": phases,
                "s_per_step": phases["time/step"],
                "steps": steps,
                "cpu_per_step": cpu_per_step,
            }
        )
    )


def train_step_worker(out_path: str, reps: int, threads: int) -> None:
    """megarl's train step against plain PyTorch on one packed batch, in this process; writes JSON."""
    import torch
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.batch import PackedBatch
    from megarl.faults.guard import NonFiniteGuard
    from megarl.learner.factory import build_learner, export_state
    from megarl.learner.parallel import ParallelLayout, initialize_parallel
    from megarl.objectives.rl_objective import build_objective
    from megarl.trainer.config_loading import load_config
    from megarl.trainer.setup import tokenizer_and_hf_config

    torch.set_num_threads(threads)
    work = Path(tempfile.mkdtemp(prefix="megarl-train-step-"))
    cfg = load_config(ROOT / "examples/quickstart.yaml", megarl_overrides(2, str(work / "run")))
    tok, hf = tokenizer_and_hf_config(cfg)
    groups = initialize_parallel(ParallelLayout(tp=1))
    learner = build_learner(
        hf, groups, cfg.optimizer, cfg.model.params_dtype, cfg.model.seed, fused_output=cfg.model.fused_output
    )
    if cfg.faults.detect and cfg.faults.detectors.skip_nonfinite:
        NonFiniteGuard(learner).install()  # as the run does
    objective = build_objective(cfg.objective)

    # the batch: one step's prompts x N samples of 1..MAX_NEW random tokens (EOS ends the shorter)
    g = torch.Generator().manual_seed(0)
    rows = [json.loads(x) for x in (ROOT / "examples/data/reverse3-train.jsonl").read_text().splitlines()]
    prompts = [tok.encode(r["prompt"]) for r in rows[:PROMPTS] for _ in range(N)]
    B = len(prompts)
    resp_len = torch.randint(1, MAX_NEW + 1, (B,), generator=g)
    resp_len[torch.rand(B, generator=g) < 0.7] = MAX_NEW
    seqs, masks = [], []
    for p, n in zip(prompts, resp_len.tolist()):
        r = torch.randint(0, tok.vocab_size, (n,), generator=g)
        if n < MAX_NEW:
            r[-1] = tok.eos_id
        seqs.append(torch.cat([torch.tensor(p), r]))
        masks.append(torch.cat([torch.zeros(len(p)), torch.ones(n)]))
    rewards = (torch.rand(B, generator=g) < 0.5).float().view(PROMPTS, N)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
    lens = torch.tensor([len(x) for x in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    mask = torch.cat(masks)
    batch = PackedBatch(
        tokens=torch.cat(seqs),
        cu_seqlens=cu,
        prompt_lens=torch.tensor([len(p) for p in prompts]),
        loss_mask=mask,
        group_ids=torch.arange(B) // N,
        advantages=adv.repeat_interleave(lens) * mask,
    ).validate()

    # the plain side: transformers' model with the learner's weights, the batch right-padded
    hf_cfg = AutoConfig.for_model(**hf)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(export_state(learner), strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        sys.exit(f"step_speed: HF weights do not match: missing {missing}, unexpected {unexpected}")
    model.train()
    o = cfg.optimizer
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=o.lr,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
        weight_decay=o.weight_decay,
    )
    L = int(lens.max())
    ids = torch.full((B, L), tok.pad_id)
    pmask = torch.zeros(B, L)
    padv = torch.zeros(B, L)
    for i, (x, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(x)] = x
        pmask[i, : len(x)] = m
        padv[i] = adv[i]
    tgt, pm, pa = ids[:, 1:], pmask[:, 1:], padv[:, 1:]
    clip_low, clip_high = cfg.objective.clip_low, cfg.objective.clip_high

    def plain() -> float:
        logits = model(ids).logits[:, :-1].float()
        return float(plain_update(model, opt, logits, tgt, pa, pm, clip_low, clip_high, o.clip_grad))

    def plain_outside_mode() -> float:  # the CPU shims' torch-function mode is megarl's cost only
        mode = _get_current_function_mode()
        if mode is None:
            return plain()
        with _pop_mode_temporarily():
            return plain()

    def megarl() -> float:
        return learner.train_step(batch, objective, 1, old_from_forward=True)["loss"]

    first = {"megarl": megarl(), "plain": plain_outside_mode()}
    times: dict[str, list[tuple[float, float]]] = {"megarl": [], "plain": []}
    load = [os.getloadavg()[0]]
    for _ in range(reps):
        for name, f in (("megarl", megarl), ("plain", plain_outside_mode)):
            c0, t0 = time.thread_time(), time.perf_counter()
            f()
            times[name].append((time.thread_time() - c0, time.perf_counter() - t0))
    load.append(os.getloadavg()[0])
    res = {
        "tokens": int(cu[-1]),
        "padded_tokens": B * L,
        "reps": reps,
        "first_loss": first,
        "load": load,
        **{
            f"{k}_{what}_ms": 1000 * statistics.median(t[i] for t in v)
            for k, v in times.items()
            for i, what in enumerate(("cpu", "wall"))
        },
    }
    Path(out_path).write_text(json.dumps(res))


def run_train_step(reps: int, threads: int, work: Path) -> dict:
    """``train_step_worker`` in its own process."""
    env = dict(
        os.environ, MEGARL_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT)
    )
    out = work / "train_step.json"
    cmd = [sys.executable, __file__, "--train-step-worker", str(out), "--reps", str(reps)]
    with open(work / "train_step.log", "w") as log:
        rc = subprocess.call(cmd + ["--threads", str(threads)], env=env, cwd=ROOT, stdout=log, stderr=log)
    if rc != 0:
        sys.exit(f"step_speed: the train-step comparison exited {rc}; see {work / 'train_step.log'}")
    return json.loads(out.read_text())


def report_train_step(t: dict) -> None:
    """Print megarl's train step against the plain one."""
    print(
        f"train step vs plain forward+backward+AdamW on the same packed batch ({t['tokens']} tokens; "
        f"plain: {t['padded_tokens']} padded; one process, interleaved, median of {t['reps']}, "
        f"load average {t['load'][0]:.1f}-{t['load'][1]:.1f}):"
    )
    print(f"{'':<34} {'megarl':>12} {'plain':>12} {'ratio':>8}")
    for what in ("cpu", "wall"):
        m, b = t[f"megarl_{what}_ms"], t[f"plain_{what}_ms"]
        print(
            f"{'  thread CPU ms' if what == 'cpu' else '  wall ms':<34} {m:>12.1f} {b:>12.1f} {m / b:>7.2f}x"
        )
    f = t["first_loss"]
    print(f"{'  loss at the first step':<34} {f['megarl']:>12.6f} {f['plain']:>12.6f}")


def report(m: dict, b: dict | None) -> None:
    """Print megarl's figures, the baseline's and megarl / baseline."""

    def row(name: str, mv: float, bv: float | None, fmt: str = "{:.3f}") -> None:
        bs = fmt.format(bv) if bv is not None else "-"
        ratio = f"{mv / bv:.2f}x" if bv else "-"
        print(f"{name:<34} {fmt.format(mv):>12} {bs:>12} {ratio:>8}")

    print(f"{'':<34} {'megarl':>12} {'baseline':>12} {'ratio':>8}")
    row("median s/step (steps >= 2)", m["s_per_step"], b and b["s_per_step"])
    for k in PHASES[:-1]:
        row(f"  {k}", m["phases"][k], b and b["phases"].get(k))
    row("CPU s/step (mean, steps 2..N-1)", m.get("cpu_per_step", float("nan")), b and b["cpu_per_step"])
    row("CPU s, whole process", m["cpu_s"], b and b["cpu_s"], "{:.1f}")
    row("wall s, whole process", m["wall_s"], b and b["wall_s"], "{:.1f}")
    row("peak RSS MiB", m["peak_rss_mib"], b and b["peak_rss_mib"], "{:.0f}")
    row("voluntary ctx switches", m["vol_ctx"], b and b["vol_ctx"], "{:.0f}")
    row("  per step", m["vol_ctx"] / m["steps"], b and b["vol_ctx"] / b["steps"], "{:.0f}")
    row("involuntary ctx switches", m["invol_ctx"], b and b["invol_ctx"], "{:.0f}")
    top = sorted(m["threads"].items(), key=lambda kv: -kv[1][1])[:8]
    print(
        "megarl threads by voluntary ctx switches (last seen; name x threads): "
        + ", ".join(f"{n} x{k:.0f} {c:.0f}" for n, (k, c, _) in top)
    )
    top = sorted(m["threads"].items(), key=lambda kv: -kv[1][2])[:5]
    print(
        "megarl threads by CPU s (last seen): " + ", ".join(f"{n} x{k:.0f} {s:.1f}" for n, (k, _, s) in top)
    )


def main() -> None:
    """Parse the arguments, run both sides (or the baseline worker), print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each side")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--megarl-arg", action="append", default=[], help="extra megarl override (repeatable)")
    ap.add_argument("--workdir", help="where the runs and logs go (default: a temporary directory)")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--reps", type=int, default=30, help="steps of each side in the train-step comparison")
    ap.add_argument("--skip-train-step", action="store_true", help="no train-step comparison")
    ap.add_argument("--train-step-only", action="store_true", help="only the train-step comparison")
    ap.add_argument("--baseline-worker", metavar="OUT", help=argparse.SUPPRESS)
    ap.add_argument("--train-step-worker", metavar="OUT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline_worker:
        sys.path.insert(0, str(ROOT))
        baseline_worker(args.baseline_worker, args.steps, args.threads)
        return
    if args.train_step_worker:
        sys.path.insert(0, str(ROOT))
        train_step_worker(args.train_step_worker, args.reps, args.threads)
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="megarl-step-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    m = b = t = None
    if not args.train_step_only:
        m = run_megarl(args.steps, args.threads, work, args.megarl_arg)
        b = None if args.skip_baseline else run_baseline(args.steps, args.threads, work)
    if not args.skip_train_step:
        t = run_train_step(args.reps, args.threads, work)
    print(f"{args.threads} torch thread(s), load average {load:.1f} at start; logs in {work}")
    if m is not None:
        print(f"{args.steps} steps of the RL loop:")
        report(m, b)
    if t is not None:
        report_train_step(t)
    if args.json:
        Path(args.json).write_text(json.dumps({"megarl": m, "baseline": b, "train_step": t}, indent=1))


if __name__ == "__main__":
    main()
