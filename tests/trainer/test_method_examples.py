"""Every examples/methods/*.yaml runs 2 RL steps in the real trainer, on the tiny dense model and on
the tiny Qwen3-MoE (8 experts, top-2) with EP=2 over 2 gloo ranks.

One trainer process group per model type runs all examples in turn (tests/trainer/method_smoke.py:
shared warm-up, engine and data; per example a fresh learner, objective, estimator state and
shaper built by the trainer's own code); each example reports one JSON line and is one test here.
Checked per example: both steps ran with a finite loss, the weights moved, the engine generated
with exactly the learner's weights (old-logprob gap), and the method's own signal is there (GEPO's
history, EPPO's task state, the shaper's statistics, judge calls, RRPO's head, ...). Examples the
trainer cannot run yet are skipped with the runner's reason.

The same process then runs ASYNC_EXAMPLES through the asynchronous loop (``--async``: the
trainer's own producer, max_staleness 1), on both models: every step has a finite loss and the
method part's own metric, and every sample's recorded policy version is within the bound.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.method_smoke import UNSUPPORTED, example_names

ROOT = Path(__file__).parents[2]

pytestmark = pytest.mark.slow
MODELS = ("dense", "moe")
STEPS = 2
# flow-model methods -> their metric prefix: a Megatron flow DiT trains, the LM policy does not
FLOW_METHODS = {"lc-grpo": "lc_grpo", "flowcts": "flowcts"}
# (example, a metric its method part writes every step) run again through the asynchronous loop
ASYNC_EXAMPLES = [
    ("reward-floor", "shaping/reward_floor/copied_frac"),  # a reward shaper (round processor)
    ("gigpo", "adv/steps_per_seq"),  # multi-turn episodes (environment: retry)
    # the agents family: its workflows (reflect, review, instructed, retry) and context passes
    ("srpo", "srpo/patch_frac"),
    ("crpo", "self_teacher/forwarded_frac"),
    ("reflectrl", "reflect_logprobs/forwarded_frac"),
    ("el", "coach/knowledge_frac"),
    ("ice", "instruction_logprobs/forwarded_frac"),
    ("srrl", "srrl/memory_size"),
    ("taspo", "pi_bank/size"),
    ("trial", "hindsight_logprobs/forwarded_frac"),
    ("agent-opsd", "self_teacher/forwarded_frac"),
    ("regen", "regen/replay_written"),  # episodes stored with their behaviour NLL (stale ones too)
    ("regen-replay", "train/regen/weight"),  # ... replayed by the method's batch source (no rollouts)
    # the allocation family: the streaming scheduler and prefix-then-continue rounds
    ("sara", "alloc/prompts_committed"),
    ("pair", "pair/kept_frac"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RESULTS: dict[str, dict] = {}


def results(model: str, tmp_root: Path) -> dict[str, dict]:
    """Run the smoke runner for ``model`` once per session; example name -> its JSON result."""
    if model in _RESULTS:
        return _RESULTS[model]
    work = tmp_root / f"smoke-{model}"
    out = work / "results.jsonl"
    work.mkdir(parents=True, exist_ok=True)
    runner = [
        str(ROOT / "tests" / "trainer" / "method_smoke.py"),
        "--model",
        model,
        "--work",
        str(work),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--async",
        ",".join(name for name, _ in ASYNC_EXAMPLES),
    ]
    if model == "moe":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_free_port()),
            *runner,
        ]
    else:
        cmd = [sys.executable, *runner]
    env = dict(os.environ, MEGARL_NUM_THREADS="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    got = {}
    if out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line)
            got[r["example"] + ("@async" if r.get("loop") == "async" else "")] = r
    got["__run__"] = {"returncode": p.returncode, "tail": p.stdout[-2000:] + p.stderr[-3000:]}
    _RESULTS[model] = got
    return got


def _last(r: dict, key: str):
    return r["steps"][-1].get(key)


def _any(r: dict, key: str) -> list:
    return [s[key] for s in r["steps"] if key in s]


# method-specific evidence that the method's inputs reached it (beyond the generic checks)
def check_signal(name: str, r: dict) -> None:
    st = r["state"]
    if name == "sara":  # streaming allocation: per-prompt decisions, history checkpointed
        assert st["method"]["allocator"] == ["history", "mu", "totals"], st
        assert len(_any(r, "alloc/prompts_opened")) == STEPS and len(_any(r, "budget/samples")) == STEPS
    if name == "specroll":  # every rollout went through the speculative decoder; its heads are checkpointed
        tpf = _any(r, "specroll/tokens_per_forward")
        assert len(tpf) == STEPS and all(t >= 1.0 for t in tpf), tpf
        assert st["method"]["SpecRollPart"] == ["buffer", "ema", "heads", "low", "slow_updates", "totals"], st
    if name == "llmzero":  # as a run: the diagnoser's flags every step, its window checkpointed
        assert len(_any(r, "llmzero/kl_high")) == STEPS and st["method"]["step_hooks"] == [["recent"]], st
    if name == "pair":  # prefix-then-continue: prefixes and continuations counted, predictor checkpointed
        assert st["method"]["allocator"] == ["cont_len", "history", "totals", "weights"], st
        assert len(_any(r, "alloc/continuation_tokens")) == STEPS and len(_any(r, "pair/kept_frac")) == STEPS
    if name == "gepo":
        assert st["method"]["inputs"] == ["estimator"], st  # the entropy history is checkpointed
        assert _any(r, "adv/gepo_h_mean") and _any(r, "rollout/entropy_old")
    elif name == "eppo":
        assert st["objective"] == ["policy_loss"], st  # per-task entropy EMA in the objective state
        assert _any(r, "rollout/entropy_old") and _any(r, "train/eppo/clip_scale")
    elif name in ("gigpo", "pgpo"):
        assert max(_any(r, "adv/steps_per_seq")) > 1.0  # multi-turn episodes (environment: retry)
    elif name == "dash":
        assert max(_any(r, "adv/dash_checkpoints_per_seq")) > 0
    elif name == "rspo":
        assert max(_any(r, "adv/std")) > 0  # the process reward reaches groups with equal outcomes
    elif name == "amrp":
        w = [_last(r, "shaping/amrp/w/correct"), _last(r, "shaping/amrp/w/format")]
        assert abs(sum(w) - 1) < 1e-6 and min(w) >= 0.02, w
        assert "shaping" in st["method"]
    elif name == "rubric-dropout":
        kept = _any(r, "shaping/rubric_dropout/kept_frac")
        assert len(kept) == STEPS and min(kept) < 1.0, kept
    elif name == "reward-floor":
        assert len(_any(r, "shaping/reward_floor/copied_frac")) == STEPS
    elif name == "cedar-grpo":
        assert _last(r, "judge/calls") > 0 and _any(r, "shaping/cedar/coverage")
    elif name == "care":
        assert _last(r, "judge/calls") > 0 and _last(r, "shaping/care/criteria_mean") >= 2
        assert "shaping" in st["method"]
    elif name == "rrpo":
        assert _last(r, "rrpo/head_loss_last") < _last(r, "rrpo/head_loss_first")
        assert st["method"].get("rrpo") == ["head"]
    elif name == "cokl":
        assert len(_any(r, "train/reg/cokl")) == STEPS
    elif name in ("core-onpolicy-distill", "core-onpolicy-distill-engine", "core-distill-full-vocab"):
        # teacher logprobs from the Megatron teacher / the teacher engine; full-vocab: its logits
        d = _any(r, "train/distill")
        assert len(d) == STEPS and any(x != 0 for x in d), d
        t = r["teacher"]  # a trained teacher (MoE), not random weights: it knows the task
        assert t["eval_nll"] < 0.5 * t["student_eval_nll"], t
    elif name in ("geosd", "geosd-natural"):  # only its term trains; the lagged copy refreshed at step 1
        reg = "train/reg/geosd" if name == "geosd" else "train/reg/geosd_natural"
        assert len(_any(r, reg)) == STEPS and _any(r, "train/pg_loss") == [0.0] * STEPS
        assert _any(r, "geosd/checkpoint_age") == [0.0, 1.0]
    elif name == "srpo":  # patches were made, and read by the privileged forward
        assert min(_any(r, "srpo/patch_frac")) > 0 and min(_any(r, "reflection_logprobs/forwarded_frac")) > 0
    elif name == "crpo":  # the self-teacher read its context (the smoke gives it the answer)
        assert min(_any(r, "self_teacher/forwarded_frac")) > 0 and _any(r, "rollout/entropy_old")
    elif name == "reflectrl":  # transfer copies in both steps, read again with their reflection context
        assert min(_any(r, "reflect_logprobs/forwarded_frac")) > 0
    elif name == "taspo":  # step 1's verified successes are step 2's PI; the bank is checkpointed
        assert _any(r, "pi_bank/size")[-1] > 0 and _any(r, "pi_logprobs/forwarded_frac")[-1] > 0
        assert st["method"]["PIBank"] == ["entries"], st
    elif name == "trial":  # every episode read with its own outcome; the term trains
        assert (
            min(_any(r, "hindsight_logprobs/forwarded_frac")) == 1.0
            and len(_any(r, "train/reg/trial")) == STEPS
        )
    elif name == "agent-opsd":  # the self-teacher read the answer on every episode
        assert min(_any(r, "self_teacher/forwarded_frac")) == 1.0
    elif name == "tide":  # only the TIDE term trains (no policy loss, no KL); its inputs reached it
        assert len(_any(r, "train/reg/tide")) == STEPS and _any(r, "train/pg_loss") == [0.0] * STEPS
    elif name == "bounded-advantages":  # the plugin: its step hook ran and its state is checkpointed
        assert len(_any(r, "bounded/clipped_frac")) == STEPS and st["method"]["step_hooks"] == [
            ["clipped_total"]
        ]
    elif name == "first-wrong-digit":  # the user's own workflow ran: episodes longer than one turn (6)
        assert max(_any(r, "rollout/response_len_max")) > 6, _any(r, "rollout/response_len_max")
    elif name in ("ppo-critic", "ppo-or"):  # the critic filled the values GAE read and trained in the step
        assert len(_any(r, "critic/value_loss")) == STEPS and len(_any(r, "critic/values_old")) == STEPS
        assert st["method"]["step_hooks"] == [[]], st  # its state is sharded (hook_0/ in checkpoints)
    elif name == "sao":  # one rollout per prompt, the critic's warm-up (step 1), then the strict clip
        assert _any(r, "critic/warmup") == [1.0, 0.0] and len(_any(r, "critic/value_loss")) == STEPS
        assert len(_any(r, "train/sao_clip/out_of_band_frac")) == 1, r["steps"]
    elif name == "ppo-shared":  # the policy's own value head: V_old from it, trained in the policy's step
        assert len(_any(r, "train/reg/value_head")) == STEPS and not _any(r, "critic/value_loss"), r["steps"]
        assert _any(r, "critic/values_old")[0] == 0.0 and _any(r, "critic/values_old")[1] != 0.0, r["steps"]
        assert st["method"]["step_hooks"] == [[]], st  # the head is in the policy's own checkpoint
    elif name in ("bpco", "bpco-privileged"):  # the critic's warm-up: step 1 the critic only, step 2 both
        assert _any(r, "critic/warmup") == [1.0, 0.0] and len(_any(r, "critic/value_loss")) == STEPS
        assert r["steps"][0]["train/optimizer_steps"] == 0 and "train/loss" not in r["steps"][0]
        assert all(0.0 <= v <= 1.0 for v in _any(r, "critic/values_old"))  # bounds: [0, 1]
        assert st["method"]["step_hooks"] == [[]], st
        if name == "bpco-privileged":  # the critic read the answers (3 digits) after each prompt
            assert _any(r, "critic/context_len") == [3.0] * STEPS and "CriticContext" in st["method"], st
    elif name in ("comppo", "sapo"):  # the head on the policy's trunk filled the values and trained
        assert len(_any(r, "critic/value_loss")) == STEPS, r["steps"]
        assert st["method"]["step_hooks"] == [["head", "optim"]], st  # the head and its Adam state
        if name == "comppo":  # the attention concentration reached the gate: inside (0, 1), not constant
            kappa, spread = _any(r, "comp/kappa_mean"), _any(r, "comp/kappa_std")
            assert all(0.0 < k < 1.0 for k in kappa) and min(spread) > 0, (kappa, spread)
        else:  # the SARSA auxiliary trained the head at the action boundaries
            assert len(_any(r, "critic/sarsa_loss")) == STEPS, r["steps"]
    elif name == "gupo":  # the sketch pass weighted the groups every step (mean 1: min <= 1 <= max)
        lo, hi = _any(r, "gupo/weight_min"), _any(r, "gupo/weight_max")
        assert len(lo) == STEPS and all(a <= 1 + 1e-9 <= b + 2e-9 for a, b in zip(lo, hi)), (lo, hi)
        assert st["method"]["step_hooks"] == [[]], st  # stateless: the projections come from the seed
    elif name == "gcpo":  # every optimizer step measured the overlap and projected part of the update away
        kept = _any(r, "gcpo/update_kept")
        assert len(_any(r, "gcpo/pso_mean")) == STEPS and all(0 < k < 1 for k in kept), kept
        assert st["method"]["step_hooks"] == [[]], st  # stateless: bases from the initial policy
    elif name in ("core-grpo", "core-reinforce-pp-baseline"):
        assert len(_any(r, "train/kl")) == STEPS  # the frozen reference learner was built
    elif name == "3po":  # a new perturbation per version, stamped on the samples
        ids = _any(r, "3po/perturbation_id")
        assert len(ids) == STEPS and len(set(ids)) == STEPS and _any(r, "3po/sigma") == [0.003] * STEPS
    elif name == "lc-grpo":  # Langevin-corrected steps carried log-probs; the DiT's shards: a hook folder
        assert _any(r, "lc_grpo/stochastic_steps") == [3.0] * STEPS, r["steps"]
        assert st["method"]["step_hooks"] == [["updates"]], st
    elif name == "flowcts":  # the trajectory-weighted loss trained the student; both DiTs sharded per rank
        assert len(_any(r, "flowcts/flowcts_loss")) == STEPS, r["steps"]
        assert st["method"]["step_hooks"] == [["updates"]], st
    elif name == "agon":  # A drafts at step 1 and reads at step 2; B steps its own optimizer; zero-sum
        assert _any(r, "agon/a_drafts") == [1.0, 0.0] and _any(r, "agon/b_optimizer_steps") == [2.0] * STEPS
        assert max(_any(r, "agon/zero_sum_residual")) < 1e-9 and st["method"]["step_hooks"] == [[]], st
        # B trained at step 1, so a small gap at step 2 means the engine served B's own weights to B
        assert max(_any(r, "agon/b_logprob_gap")) < 1e-4, _any(r, "agon/b_logprob_gap")
    elif name == "es":  # the population was scored through the engine and the hook's count is saved
        assert _any(r, "es/members") == [1.0] * STEPS and st["method"]["step_hooks"] == [["updates"]], st
    elif name == "rstg":  # the teacher reached the gated OPD term of the all-wrong groups
        nzv, dis = _any(r, "train/rstg/nzv_token_frac"), _any(r, "train/rstg/distilled_token_frac")
        assert len(dis) == STEPS and all(0 <= d <= n for d, n in zip(dis, nzv)), (nzv, dis)
        # verified teacher solutions of the all-wrong groups joined the batch and were SFT'd; the
        # MoE student's engine served its MoE teacher, the dense run sampled an embedded MoE teacher
        ver, sft = _any(r, "rstg/teacher_verified"), _any(r, "train/rstg/sft_token_frac")
        assert sum(ver) > 0 and all((v > 0) == (f > 0) for v, f in zip(ver, sft)), (ver, sft)
        assert _any(r, "rstg/run_engine_swap") == [float(r["model"] == "moe")] * STEPS
        # the Megatron teacher forwarded only the all-wrong groups' student samples, never a solution
        fwd = _any(r, "teacher/forwarded_frac")
        assert len(fwd) == STEPS and all(f < 1 for f, v in zip(fwd, ver) if v > 0), fwd
    elif name in ("isdpo", "uopsd", "uopsd-vocab"):  # routes cover the groups; targets forwarded
        names = ("grpo", "distil") if name == "isdpo" else ("skip", "distil")
        for s in r["steps"]:
            assert abs(sum(s[f"route/{k}_frac"] for k in names) - 1) < 1e-9, s
        fwd = _any(r, "self_teacher/forwarded_frac")
        assert len(fwd) == STEPS and any(f > 0 for f in fwd), fwd
        if name == "uopsd":  # the smoke reads up to 2 solutions per target: their mixture teaches
            sols = _any(r, "self_teacher/solutions_mean")
            assert len(sols) == STEPS and all(1 <= x <= 2 for x, f in zip(sols, fwd) if f > 0), sols
        if name == "uopsd-vocab":  # only the top-K KL term distils (the sampled-token term off)
            assert len(_any(r, "train/reg/uopsd_kl")) == STEPS and _any(r, "train/pg_loss") == [0.0] * STEPS
    elif name == "sc-grpo":  # the self-teacher forward ran every step (answer contexts in the smoke)
        fwd = _any(r, "self_teacher/forwarded_frac")
        assert len(fwd) == STEPS and all(f > 0 for f in fwd), fwd
    elif name == "sc-grpo-vocab":  # every step: contexts, and the full-vocabulary KL over them (> 0)
        ctx, kl = _any(r, "self_teacher/context_frac"), _any(r, "self_teacher/kl_mean")
        assert len(kl) == STEPS and all(k > 0 for k in kl) and all(c > 0 for c in ctx), (ctx, kl)
    elif name == "self-routing":  # one route per group: the route fractions cover the batch
        for s in r["steps"]:
            fr = [s[f"route/{k}_frac"] for k in ("grpo", "opsd", "regularise", "skip")]
            assert abs(sum(fr) - 1) < 1e-9, fr
    elif name == "skald-cards":  # the policy read each prompt's card: rollouts and the self-teacher
        assert _any(r, "skill_card/rollouts") == [16.0] * STEPS and _any(r, "skill_card/prompts_with_card")
        assert min(_any(r, "self_teacher/forwarded_frac")) > 0 and all(
            0 <= a <= 1 for a in _any(r, "skill_card/teacher_acc")
        )
        assert any(x > 0 for x in _any(r, "train/reg/skald_self")), r["steps"]  # the gate opened
    elif name == "skald":  # the teacher's full logits reached the tilted term every step
        assert len(_any(r, "train/reg/skald")) == STEPS
        # the smoke measures the teacher's accuracy on every prompt (2 samples each): dense through
        # an embedded MoE teacher, MoE through its own engine holding the teacher
        acc, sampled = _any(r, "skald/teacher_acc"), _any(r, "skald/teacher_sampled")
        assert len(acc) == STEPS and all(0 <= a <= 1 for a in acc) and sampled == [8.0] * STEPS
        assert _any(r, "skald/run_engine_swap") == [float(r["model"] == "moe")] * STEPS
    elif name == "clip-cov":  # the draw counter of the covariance selection is checkpointed
        assert st["objective"] == ["policy_loss"], st
        assert len(_any(r, "train/clip_cov/selected_frac")) == STEPS
    elif name == "kl-reward":  # the KL controller is the estimator's checkpointed state
        assert st["method"]["inputs"] == ["estimator"], st
        assert len(_any(r, "kl_reward/coef")) == STEPS
    else:  # losses with their own token diagnostics, round inputs with their own metric
        key = {
            "gapo": "train/gapo/clip_high",
            "pac": "pac/reverse/prompts",  # the curriculum chose the step's prompts
            "trajval": "trajval/reverse/prompts",  # the prior chose the step's prompts
            "mass": "mass/selected",  # the steps drew from the selection
            "estr": "train/estr/masked_frac",
            # the rollout corrections: their share of zeroed (or dropped) loss tokens, every step
            "core-seq-tis": "train/correction_zeroed_frac",
            "core-is-rejection": "train/correction_zeroed_frac",
            "core-rejection-drop": "train/correction_dropped_frac",
            "output-reset": "train/output_reset/residual",
            "gmpo": "train/gmpo/clipped_frac",
            "kl-cov": "train/kl_cov/selected_frac",
            "bypass": "train/bypass_reinforce/is_weight",
            "remax": "remax/baseline_mean",
            "otb": "otb/sum_pi_sq_mean",
            "distilled-rl": "distilled_rl/shaped_frac",  # the teacher reached the estimator
            "opd-regulation": "opd_regulation/reward_mean",
            "ra-opd": "ra_opd/kept_frac",
            "opdvr": "opdvr/zeroed_frac",
            "grpd": "grpd/zeroed_frac",
            "regen": "regen/replay_written",
            "el": "train/el/coached",  # the coach's knowledge reached the loss
            "ice": "train/ice/sd_frac",  # the instruction forward reached the loss
            "srrl": "srrl/memory_size",  # the memory reported every step
        }.get(name)
        if key is not None:
            assert len(_any(r, key)) == STEPS, sorted(r["steps"][-1])
        if name == "regen":
            assert len(_any(r, "train/regen/weight")) == STEPS and min(_any(r, key)) > 0


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", example_names())
def test_example_runs_in_the_trainer(name, model, tmp_path_factory):
    if name in UNSUPPORTED:
        pytest.skip(UNSUPPORTED[name])
    res = results(model, tmp_path_factory.getbasetemp())
    assert name in res, (
        f"no result for {name} ({model}); runner rc={res['__run__']['returncode']}:\n"
        + res["__run__"]["tail"]
    )
    r = res[name]
    assert "error" not in r, r.get("traceback", r.get("error"))
    assert [s["step"] for s in r["steps"]] == list(range(1, STEPS + 1))
    for s in r["steps"]:
        # the engine sampled with exactly the learner's weights (dense and MoE, EP=2); 3PO's engine
        # samples with θ + σε while the learner keeps θ
        gap = s["rollout/logprob_gap_old"]
        if name == "ice":  # sampled with an instruction after the prompt, trained without it
            assert math.isfinite(gap), gap
        elif name == "reflectrl":  # transfer copies keep the engine's logprobs under the reflection
            assert math.isfinite(gap), gap  # context and are trained without it (docs/methods/reflectrl.md)
        elif name == "rstg":  # appended teacher solutions carry the teacher's sampling logprobs
            assert math.isfinite(gap), gap
        else:
            assert gap > 1e-4 if name == "3po" else gap < 1e-4, gap
        if s.get("critic/warmup") == 1.0:  # a critic warm-up step holds the policy (checked below)
            continue
        if name == "es":  # ES steps the weights itself: no policy-gradient step
            assert s["train/optimizer_steps"] == 0 and s["es/active"] == 1.0, s
            continue
        if name in FLOW_METHODS:  # the flow model trains in the step hook; the LM policy is held still
            assert s["train/optimizer_steps"] == 0 and s[f"{FLOW_METHODS[name]}/update_norm"] > 0, s
            # the DiT follows the layout: dense, or 2 x ep = 4 experts split over EP=2
            assert s[f"{FLOW_METHODS[name]}/flow_experts"] == (4.0 if model == "moe" else 0.0), s
            continue
        assert math.isfinite(s["train/loss"]) and math.isfinite(s["train/grad_norm"]), s
        assert s["train/update_successful"] == 1.0 and s["train/optimizer_steps"] == 2  # 2 mini-batches
    assert r["param_change"] > 0 or name in FLOW_METHODS, "the weights did not move"
    check_signal(name, r)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name, signal", ASYNC_EXAMPLES)
def test_example_runs_in_the_async_loop(name, signal, model, tmp_path_factory):
    """The asynchronous producer runs the same collector as the synchronous loop: reward shapers,
    multi-turn workflows, context passes and streaming allocators work there too, within the bound."""
    res = results(model, tmp_path_factory.getbasetemp())
    key = f"{name}@async"
    assert key in res, (
        f"no async result for {name} ({model}); runner rc={res['__run__']['returncode']}:\n"
        + res["__run__"]["tail"]
    )
    r = res[key]
    assert "error" not in r, r.get("traceback", r.get("error"))
    assert [s["step"] for s in r["steps"]] == list(range(1, STEPS + 1))
    for s in r["steps"]:
        assert signal in s, sorted(s)
        assert math.isfinite(s["train/loss"]) and s["train/update_successful"] == 1.0, s
        if name == "regen-replay":  # no rollouts: nothing generated, nothing stale
            assert "rollout/samples" not in s and "async/versions" not in s, s
            continue
        assert s["async/train_version"] == s["step"] - 1
        versions = [int(v) for v in s["async/versions"]]
        assert versions and all(0 <= s["step"] - 1 - v <= 1 for v in versions), s["async/versions"]
    assert r["param_change"] > 0, "the weights did not move"
    if name == "gigpo":
        assert max(_any(r, "adv/steps_per_seq")) > 1.0  # real multi-turn episodes
    if name == "regen-replay":  # the episodes the asynchronous run wrote train alike when replayed
        for sa, sb in zip(res["regen@async"]["steps"], r["steps"], strict=True):
            assert sb["train/loss"] == pytest.approx(sa["train/loss"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("model", MODELS)
def test_async_examples_ran_ahead_of_the_learner(model, tmp_path_factory):
    """The producer generated batches while the learner trained: some sample has staleness 1."""
    res = results(model, tmp_path_factory.getbasetemp())
    steps = [s for n, _ in ASYNC_EXAMPLES for s in res.get(f"{n}@async", {}).get("steps", [])]
    stale = [s["async/staleness_max"] for s in steps if "async/staleness_max" in s]
    assert stale and max(stale) == 1, stale


@pytest.mark.parametrize("model", MODELS)
def test_engine_teacher_gives_the_megatron_teachers_loss(model, tmp_path_factory):
    """Same rollouts (same seeds, same initial policy), same trained teacher: the first step's
    distillation loss with teacher.source: engine (embedded HF teacher) equals the Megatron teacher's."""
    res = results(model, tmp_path_factory.getbasetemp())
    a, b = res.get("core-onpolicy-distill"), res.get("core-onpolicy-distill-engine")
    assert a and b and "error" not in a and "error" not in b, res["__run__"]["tail"]
    da, db = a["steps"][0]["train/distill"], b["steps"][0]["train/distill"]
    assert abs(da - db) < 1e-4 * max(1.0, abs(da)), (da, db)


@pytest.mark.parametrize("model", MODELS)
def test_regen_replay_trains_like_the_run_that_wrote_the_episodes(model, tmp_path_factory):
    """regen-replay's steps train on the episodes regen wrote (same initial policy): the same losses."""
    res = results(model, tmp_path_factory.getbasetemp())
    a, b = res["regen"], res["regen-replay"]
    assert "rollout/samples" not in b["steps"][0]  # no rollouts were taken for training
    for sa, sb in zip(a["steps"], b["steps"], strict=True):
        assert sb["train/loss"] == pytest.approx(sa["train/loss"], rel=1e-5, abs=1e-6)
        assert sb["train/regen/weight"] == pytest.approx(sa["train/regen/weight"], rel=1e-5)
