"""What the configured methods need beyond the core batch, and the advantage estimator's state.

The trainer builds one ``MethodInputs`` per run (beside the objective). It knows, from the
configured advantage estimator, policy loss and regularisers, which batch inputs the step must
produce, fills the ones that come from the batch itself and keeps the estimator's state (GEPO's
entropy history) across steps and checkpoints:

- ``entropies`` [T]: full-vocab entropy of the behaviour policy, from the learner's old-logprob
  pass (GEPO, EPPO);
- ``ref_logprobs`` [T]: from the frozen reference learner (KL, CoKL);
- ``teacher_logprobs`` [T]: from the forward-only teacher learner (``teacher.hf_dir``; on-policy
  distillation);
- ``steps``: ``turn_spans`` and ``extras["step_state_keys"]`` [B, S] (GiGPO, PGPO). A single-turn
  batch (the quickstart) gets one prompt span and one assistant span per sequence, so every
  response is one step whose anchor state is its prompt;
- ``answer_checkpoints``: ``extras["dash_ends"]``, ``extras["dash_correct"]`` [B, K] (DASH), from
  the decoded response tokens and ``credit.answer_pattern``;
- ``reward_dims``: ``rewards`` [B, K] with ``reward_names`` (RSPO);
- ``rrpo_scores``: ``extras["rrpo_scores"]`` [B], made on rank 0 (megarl/trainer/rrpo_scores.py).

A method declares its inputs with a ``batch_inputs`` attribute on its registered function; the
table below covers the methods registered before that convention.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megarl.batch import PackedBatch

# inputs of registered parts that do not declare ``batch_inputs`` themselves
_ESTIMATOR_INPUTS = {"gepo": ("entropies",), "dash": ("answer_checkpoints",), "gigpo": ("steps",),
                     "pgpo": ("steps",), "rspo": ("reward_dims",), "rrpo": ("rrpo_scores",)}
_POLICY_LOSS_INPUTS = {"eppo": ("entropies",)}
_REGULARISER_INPUTS = {"cokl": ("ref_logprobs",)}


def _declared(fn: Any, name: str, table: dict) -> tuple[str, ...]:
    return tuple(getattr(fn, "batch_inputs", ())) or table.get(name, ())


def required_inputs(cfg) -> set[str]:
    """The batch inputs the run's estimator, policy loss and regularisers need (see the module doc)."""
    from megarl.advantages import ADVANTAGE_ESTIMATORS
    from megarl.objectives.policy_losses import POLICY_LOSSES
    from megarl.objectives.regularisers import REGULARISERS

    need = set(_declared(ADVANTAGE_ESTIMATORS.get(cfg.advantage.estimator), cfg.advantage.estimator,
                         _ESTIMATOR_INPUTS))
    o = cfg.objective
    need |= set(_declared(POLICY_LOSSES.get(o.policy_loss), o.policy_loss, _POLICY_LOSS_INPUTS))
    for reg in o.regularisers:
        need |= set(_declared(REGULARISERS.get(reg["name"]), reg["name"], _REGULARISER_INPUTS))
    if o.kl_coef:
        need.add("ref_logprobs")
    if o.distill != "none":
        need.add("teacher_logprobs")
    return need


def teacher_hf_config(cfg, policy_hf: dict) -> dict:
    """The teacher's HF config (``teacher.hf_dir``), checked to share the policy's vocabulary; with
    the char tokenizer the special token ids are the tokenizer's, as for the policy."""
    from megarl.learner.model import load_hf_config
    from megarl.trainer.config import ConfigError

    if not cfg.teacher.hf_dir:  # checked when the run starts: the example configs carry no teacher
        raise ConfigError(f"objective.distill={cfg.objective.distill!r} needs teacher.hf_dir (the teacher's HF "
                          "checkpoint, sharing the policy's vocabulary)")
    hf = dict(load_hf_config(cfg.teacher.hf_dir))
    if int(hf.get("vocab_size", -1)) != int(policy_hf["vocab_size"]):
        raise ConfigError(f"teacher.hf_dir={cfg.teacher.hf_dir}: vocab_size {hf.get('vocab_size')} differs from the "
                         f"policy's {policy_hf['vocab_size']} (distillation compares logprobs of the same tokens)")
    for k in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if k in policy_hf:
            hf[k] = policy_hf[k]
    return hf


def single_turn_spans(batch: PackedBatch) -> list[list[tuple[int, int, str]]]:
    """One ``prompt`` span and one ``assistant`` span (the response) per sequence."""
    lens, plens = batch.seq_lens.tolist(), batch.prompt_lens.tolist()
    return [[(0, p, "prompt"), (p, n, "assistant")] if n > p else [(0, p, "prompt")]
            for p, n in zip(plens, lens)]


def dash_checkpoint_extras(batch: PackedBatch, tokenizer: Any, answers: Sequence[str],
                           pattern: str) -> dict[str, torch.Tensor]:
    """DASH's ``dash_ends`` / ``dash_correct`` [B, K] from each response's decoded tokens: every
    match of ``pattern`` is an answer commitment, correct when its first group (else the whole
    match) equals the sequence's ground truth."""
    from megarl.methods.credit.dash import answer_checkpoints, checkpoints_to_extras

    cps = []
    for i in range(batch.num_seqs):
        s, e, p = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1]), int(batch.prompt_lens[i])
        pieces = [tokenizer.decode([t]) for t in batch.tokens[s + p:e].tolist()]
        cps.append(answer_checkpoints(pieces, p, answers[i], pattern))
    return checkpoints_to_extras(cps)


class MethodInputs:
    """Per-run method machinery beside the objective: required inputs, estimator + its state."""

    def __init__(self, cfg):
        from megarl.advantages import ADVANTAGE_ESTIMATORS

        self.cfg = cfg
        self.estimator = cfg.advantage.estimator
        self.knobs = dict(cfg.advantage.knobs)
        fn = ADVANTAGE_ESTIMATORS.get(self.estimator)
        self.estimator_fn = fn
        # stateful estimators (GEPO's entropy history): made once per run, saved in checkpoints
        self.estimator_state = fn.make_state(**self.knobs) if hasattr(fn, "make_state") else None
        self.inputs = required_inputs(cfg)

    @property
    def needs_entropies(self) -> bool:
        """Whether the old-logprob pass must also return the full-vocab entropies."""
        return "entropies" in self.inputs

    @property
    def needs_ref(self) -> bool:
        """Whether the run needs a frozen reference learner."""
        return "ref_logprobs" in self.inputs

    @property
    def needs_teacher(self) -> bool:
        """Whether the run needs a teacher learner (on-policy distillation)."""
        return "teacher_logprobs" in self.inputs

    @property
    def needs_rrpo_scores(self) -> bool:
        return "rrpo_scores" in self.inputs

    def fill_batch(self, batch: PackedBatch, tokenizer: Any, answers: Sequence[str],
                   reward_dims: dict[str, Sequence[float]], extras: dict[str, Sequence[float]] | None = None
                   ) -> PackedBatch:
        """Add the inputs that come from the batch and the rollouts (steps, DASH checkpoints,
        reward dimensions, per-sequence extras made on rank 0). Returns ``batch`` (modified)."""
        from megarl.methods.credit.steps import anchor_state_keys

        for k, v in (extras or {}).items():
            batch.extras[k] = torch.as_tensor(v, dtype=torch.float64)
        if "steps" in self.inputs:
            if batch.turn_spans is None:
                batch.turn_spans = single_turn_spans(batch)
            batch.extras["step_state_keys"] = anchor_state_keys(batch)
        if "answer_checkpoints" in self.inputs:
            batch.extras.update(dash_checkpoint_extras(batch, tokenizer, answers, self.cfg.credit.answer_pattern))
        if "reward_dims" in self.inputs:
            names = list(reward_dims)
            batch.reward_names = names
            batch.rewards = torch.stack([torch.as_tensor(reward_dims[n], dtype=torch.float32) for n in names], 1)
        if self.needs_rrpo_scores and "rrpo_scores" not in batch.extras:
            raise ValueError("advantage.estimator=rrpo: the rollouts carry no 'rrpo_scores'")
        return batch

    def advantages(self, batch: PackedBatch) -> torch.Tensor:
        """Fill ``batch.advantages`` [T] with the configured estimator (its state passed and updated)."""
        kw = dict(self.knobs)
        if self.estimator_state is not None:
            kw["state"] = self.estimator_state
        batch.advantages = self.estimator_fn(batch, **kw).to(torch.float32)
        return batch.advantages

    def metrics(self, batch: PackedBatch) -> dict[str, float]:
        """Method-specific diagnostics of this step (GEPO's thresholds, DASH checkpoints, steps)."""
        rec: dict[str, float] = {}
        st = self.estimator_state
        if st is not None and hasattr(st, "mean") and st.mean is not None:
            rec["adv/gepo_h_mean"] = float(st.mean)
            rec["adv/gepo_h_std"] = float(max(st.sq - st.mean ** 2, 0.0) ** 0.5)
        if batch.entropies is not None:
            m = batch.loss_mask.bool()
            rec["rollout/entropy_old"] = float(batch.entropies[m].mean()) if bool(m.any()) else 0.0
        if "dash_ends" in batch.extras:
            rec["adv/dash_checkpoints_per_seq"] = float((batch.extras["dash_ends"] >= 0).sum(1).double().mean())
        if "step_state_keys" in batch.extras:
            rec["adv/steps_per_seq"] = float((batch.extras["step_state_keys"] >= 0).sum(1).double().mean())
        return rec

    def state_dict(self) -> dict:
        """The estimator's state ({} when it has none)."""
        return {} if self.estimator_state is None else {"estimator": self.estimator_state.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; a mismatch names the estimator."""
        if (self.estimator_state is None) != ("estimator" not in state):
            raise ValueError(f"checkpoint method state has parts {sorted(state)}, but advantage.estimator="
                             f"{self.estimator!r} {'has' if self.estimator_state is not None else 'has no'} state")
        if self.estimator_state is not None:
            self.estimator_state.load_state_dict(state["estimator"])
