"""TRL's GRPOTrainer on the quickstart task: the peer side of benchmarks/peers/compare_trl.py.

Runs in the TRL venv (``bash benchmarks/peers/setup_trl.sh`` makes ``.venv-trl``), started by
compare_trl.py; not meant to be run by hand. It trains the HF checkpoint ``--init`` (weights and the
character tokenizer, written by compare_trl.py) with the hyperparameters of ``grpo_args`` and writes
one JSON file: per step its wall and CPU seconds (evaluation excluded) and the training reward, and
per evaluation the held-out accuracy, computed as ``megarl train`` computes it
(megarl/trainer/evaluation.py): greedy pass@1 and ``eval_k`` samples per prompt at the rollout
temperature on the first ``eval_samples`` held-out prompts, correct = the quickstart's verifier
(``megarl.rewards.builtin.exact_match``, imported from the checkout).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BOS = "<bos>"  # the char tokenizer's bos token: megarl's prompts start with it, so these do too


def grpo_args(a: argparse.Namespace, out_dir: str) -> dict:
    """GRPOConfig keyword arguments of the task (the table in docs/benchmarks.md maps each one to
    its ``megarl train`` key)."""
    return {
        "output_dir": out_dir,
        "per_device_train_batch_size": a.prompts * a.n,  # one generation batch = one update
        "num_generations": a.n,
        "max_completion_length": a.max_new_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "learning_rate": a.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        "max_grad_norm": 1.0,
        "beta": 0.0,
        "epsilon": a.clip,
        "epsilon_high": a.clip,
        "loss_type": "dapo",  # token-mean over the whole batch
        "scale_rewards": "group",
        "num_iterations": 1,
        "steps_per_generation": 1,
        "gradient_accumulation_steps": 1,
        "max_steps": a.steps,
        "seed": a.seed,
        "use_cpu": True,
        "bf16": False,
        "gradient_checkpointing": False,  # megarl keeps activations; TRL's default recomputes them
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def load_rows(path: Path) -> list[dict]:
    """The rows of a jsonl prompt file (``prompt``, ``answer``)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def evaluate(model, tok, rows: list[dict], k: int, max_new: int, seed: int) -> dict:
    """Greedy pass@1, pass@k and the sampled accuracy of ``model`` on ``rows`` (megarl's definitions)."""
    import torch

    from megarl.rewards.builtin import exact_match

    enc = tok([BOS + r["prompt"] for r in rows], return_tensors="pt", padding=True, padding_side="left")
    was_training = model.training
    model.eval()
    common = {"max_new_tokens": max_new, "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}
    with torch.no_grad():
        greedy = model.generate(**enc, do_sample=False, **common)
        state = torch.get_rng_state()  # eval sampling does not move the training RNG
        torch.manual_seed(seed)
        sampled = model.generate(
            **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=k, **common
        )
        torch.set_rng_state(state)
    model.train(was_training)
    P = enc["input_ids"].shape[1]
    dec = lambda ids: tok.decode(ids[P:], skip_special_tokens=True)  # noqa: E731
    g = [exact_match(dec(s), r["answer"]) for s, r in zip(greedy, rows, strict=True)]
    s = torch.tensor([exact_match(dec(x), rows[i // k]["answer"]) for i, x in enumerate(sampled)]).view(-1, k)
    return {
        "eval/pass@1": sum(g) / len(g),
        f"eval/pass@{k}": float((s > 0).any(1).float().mean()),
        "eval/sampled_acc": float(s.mean()),
    }


def main() -> None:
    """Parse the arguments, train, write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--init", required=True, help="HF checkpoint dir with the char tokenizer")
    ap.add_argument("--train", default=str(ROOT / "examples/data/reverse3-train.jsonl"))
    ap.add_argument("--eval", default=str(ROOT / "examples/data/reverse3-eval.jsonl"))
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-samples", type=int, default=200)
    ap.add_argument("--eval-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trl-arg", action="append", default=[], help="extra GRPOConfig key=value (JSON value)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))

    import torch

    torch.set_num_threads(a.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megarl.rewards.builtin import exact_match

    tok = PreTrainedTokenizerFast.from_pretrained(a.init)
    model = AutoModelForCausalLM.from_pretrained(a.init, dtype=torch.float32)
    train = Dataset.from_list(
        [{"prompt": BOS + r["prompt"], "answer": r["answer"]} for r in load_rows(Path(a.train))]
    )
    eval_rows = load_rows(Path(a.eval))[: a.eval_samples]

    def correct(prompts, completions, answer, **_) -> list[float]:
        """The quickstart's verifier: exact match of the decoded completion."""
        return [exact_match(c, x) for c, x in zip(completions, answer, strict=True)]

    steps: list[dict] = []
    evals: list[dict] = []

    class Clock(TrainerCallback):
        """Per-step wall and CPU seconds between step ends, less the evaluation inside them."""

        def __init__(self):
            self.t, self.c = time.time(), time.process_time()

        def _eval(self, step: int, mdl) -> None:
            t0, c0 = time.time(), time.process_time()
            seed = 1_000_003 * a.seed + step  # each run and evaluation draws its own samples
            rec = {"step": step, **evaluate(mdl, tok, eval_rows, a.eval_k, a.max_new_tokens, seed)}
            rec["time/eval"] = time.time() - t0
            evals.append(rec)
            self.t += time.time() - t0
            self.c += time.process_time() - c0

        def on_train_begin(self, args, state, control, model=None, **kw):
            self._eval(0, model)
            self.t, self.c = time.time(), time.process_time()

        def on_step_end(self, args, state, control, model=None, **kw):
            now, cpu = time.time(), time.process_time()
            steps.append({"step": state.global_step, "wall_s": now - self.t, "cpu_s": cpu - self.c})
            self.t, self.c = now, cpu
            if state.global_step == a.steps or (a.eval_every and state.global_step % a.eval_every == 0):
                self._eval(state.global_step, model)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs and steps:
                steps[-1]["reward"] = float(logs["reward"])

    extra = {k: json.loads(v) for k, v in (x.split("=", 1) for x in a.trl_arg)}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=correct,
        args=GRPOConfig(**{**grpo_args(a, a.work), **extra}),
        train_dataset=train,
        processing_class=tok,
        callbacks=[Clock()],
    )
    trainer.train()
    Path(a.out).write_text(json.dumps({"steps": steps, "evals": evals}))


if __name__ == "__main__":
    main()
