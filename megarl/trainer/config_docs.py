"""docs/configuration.md generated from the config dataclasses: every section and key with its
type, default and meaning. ``python -m megarl.trainer.config_docs > docs/configuration.md``
rewrites it; tests/trainer/test_config_docs.py fails when the file and the dataclasses disagree.

A key's meaning is its inline or preceding ``#`` comment in the dataclass source, else the entry in
``MEANINGS`` below; a key with neither is an error (``missing_meanings``).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from typing import Any

from megarl.trainer import config_sections as C
from megarl.trainer.config_loading import type_name
from megarl.trainer.config_migrations import moved_keys
from megarl.trainer.config_ranges import range_text

# Meanings of the keys whose dataclass field has no comment.
MEANINGS: dict[str, str] = {
    "model.hf_dir": "HF checkpoint directory (config.json + safetensors) the run starts from; null = random init from hf_config",
    "model.hf_config": "HF config dict of a model built with random weights (e.g. a tiny Qwen3); vocab and special ids come from the tokenizer",
    "model.alphabet": "characters of the char tokenizer (ids 0-2 are pad, eos, bos)",
    "model.params_dtype": "dtype of the learner's parameters",
    "model.seed": "seed of the model's random initialisation and of megatron's RNG",
    "parallel.tp": "tensor-parallel size (must divide attention heads, KV heads and vocab)",
    "parallel.pp": "pipeline-parallel size (must divide the layers)",
    "parallel.ep": "expert-parallel size (MoE only; must divide the experts)",
    "parallel.cp": "context-parallel size",
    "parallel.sequence_parallel": "megatron sequence parallelism (needs tp > 1)",
    "parallel.expert_tp": "tensor-parallel size inside the experts (null = megatron's default)",
    "parallel.world_size": "expected number of processes; 0 = whatever torchrun started",
    "rollout.engine": "where responses are generated: in this process (embedded) or on vLLM / SGLang servers",
    "rollout.urls": "base URLs of running servers (server engines, unless rollout.launch)",
    "rollout.temperature": "sampling temperature (0 = greedy)",
    "rollout.top_p": "nucleus sampling threshold (1 = off)",
    "rollout.top_k": "top-k sampling (-1 = off)",
    "rollout.max_new_tokens": "generation budget per sample (also L_max of seq-mean-token-sum-norm)",
    "rollout.max_concurrency": "requests in flight per engine",
    "rollout.embedded_batch_rows": "embedded engine: samples decoding in one batch at most (continuous batching); "
    "1 = one request at a time, bitwise reproducible across runs (a batch's composition moves logprobs "
    "in their last bits; docs/rollout.md)",
    "data.train": "training prompts: a jsonl or parquet path or glob (relative: to the config file's directory)",
    "data.eval": "held-out prompts for evaluation (same formats, paths as data.train); empty = no evaluation",
    "data.prompt_field": "row field holding the prompt",
    "data.answer_field": "row field holding the ground truth (string or number)",
    "data.task_field": "row field naming the task (batch task_ids); missing = 'default'",
    "data.prompt_template": "str.format template over the row's fields giving the prompt text",
    "data.on_bad_row": "a bad row (named by file:line or file: row N) stops the run, or is skipped and counted",
    "reward.functions": "reward dimensions (list of reward.functions[] entries below); the scalar reward is their weighted sum",
    "reward.timeout_s": "time limit of one contained reward call (python, math_verify)",
    "reward.fallback": "reward given when a contained call raises, returns a non-finite value or times out",
    "reward.shaping": "optional reward shaper {name: <REWARD_SHAPERS key>, knobs...} applied to every rollout batch",
    "reward.judge.timeout_s": "time limit of one LLM-judge call",
    "reward.judge.max_new_tokens": "generation budget of a judge reply",
    "reward.judge.temperature": "sampling temperature of the judge",
    "advantage.estimator": "advantage estimator (registry name, e.g. grpo); its keyword knobs sit beside it in the YAML",
    "advantage.knobs": "the estimator's keyword arguments (written next to estimator in the YAML)",
    "objective.policy_loss": "policy-loss term (a POLICY_LOSSES key)",
    "objective.clip_low": "PPO ratio clip below 1 (1 - clip_low)",
    "objective.clip_high": "PPO ratio clip above 1 (1 + clip_high; DAPO's clip-higher)",
    "objective.dual_clip": "dual-clip constant c > 1 for negative advantages (null = off)",
    "objective.aggregation": "how token losses become the loss (token-mean, seq-mean-token-mean, seq-mean-token-sum-norm, ...)",
    "objective.kl_coef": "weight of the KL penalty to the reference policy (0 = no reference model)",
    "objective.kl_estimator": "KL estimator (KL_ESTIMATORS key: k1, k2, k3, ...)",
    "objective.entropy_coef": "weight of the entropy bonus",
    "objective.correction": "off-policy correction of rollout/learner mismatch (CORRECTIONS key; none = off)",
    "objective.correction_low": "lower truncation bound of the correction weight",
    "objective.correction_high": "upper truncation bound of the correction weight",
    "objective.distill": "distillation term (DISTILLATION key; none = off)",
    "objective.distill_coef": "weight of the distillation term",
    "method": "a method by name ({name: <built-in>}) or from your package ({import: 'pkg.module:SPEC'}), plus its knobs",
    "inputs": "knobs of batch-input providers, per input name (`{name: {knob: value}}`)",
    "sampling.dynamic": "DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts",
    "sampling.max_rounds": "cap on sampling rounds per step with dynamic sampling",
    "optimizer.lr": "peak learning rate (Adam)",
    "optimizer.min_lr": "learning rate at the end of the decay",
    "optimizer.weight_decay": "decoupled weight decay",
    "optimizer.adam_beta1": "Adam beta1",
    "optimizer.adam_beta2": "Adam beta2",
    "optimizer.adam_eps": "Adam epsilon",
    "optimizer.clip_grad": "global gradient-norm clip; 0 = no clipping (a negative value is refused)",
    "optimizer.lr_warmup_steps": "linear LR warm-up, in optimizer steps",
    "optimizer.lr_decay_steps": "LR decay length in optimizer steps (0 = constant after warm-up)",
    "optimizer.lr_decay_style": "shape of the LR decay",
    "optimizer.use_distributed_optimizer": "megatron's distributed optimizer (optimizer state sharded over data-parallel ranks)",
    "warmup.sft_steps": "supervised warm-up steps on the training answers before RL (0 = none)",
    "warmup.batch_size": "prompts per warm-up step",
    "warmup.lr": "warm-up learning rate",
    "schedule.steps": "RL steps of the run",
    "schedule.prompts_per_step": "prompts (groups) per step; each gets rollout.n samples",
    "schedule.ppo_epochs": "passes over each step's batch",
    "schedule.mini_batches": "optimizer steps per pass (whole groups per mini-batch)",
    "schedule.micro_batches": "gradient-accumulation micro-batches per optimizer step",
    "schedule.old_logprobs": "the PPO ratio's denominator: recomputed by the learner before the update (taken from the training forward when the step is exactly one optimizer step and nothing reads them earlier), or the engine's logprobs",
    "schedule.seed": "seed of the prompt order and of the per-request sampling seeds",
    "checkpoint.every": "checkpoint every N steps (and at the last step and on SIGTERM/SIGUSR1)",
    "checkpoint.keep_last": "number of checkpoints kept",
    "checkpoint.resume": "auto: continue the run in logging.run_dir from its newest complete checkpoint; never: start a new run (a used run_dir: see on_existing)",
    "logging.run_dir": "run directory: resolved config, metrics.jsonl, checkpoints, curves.png, tensorboard/",
    "logging.print_every": "print a progress line every N steps",
    "logging.wandb_project": "wandb project name (logging.wandb)",
    "logging.plot": "render curves.png at the end of the run",
    "async_loop.enabled": "use the asynchronous loop (rollouts of the next steps generated while the learner trains)",
    "async_loop.max_staleness": "largest allowed lag (in policy versions) between the weights that generated a sample and those it trains",
    "async_loop.partial_rollout": "requests in flight at a weight update: abort = regenerate with the new weights, continue = keep the prefix and finish with the new weights",
    "async_loop.on_stale": "a group older than max_staleness when consumed is dropped or regenerated",
    # list items
    "reward.functions[].name": "name of the dimension (metrics reward/<name>/mean; multi-reward methods)",
    "reward.functions[].kind": "verifier: exact_match, regex (pattern), math_verify (math-verify package, contained), python (function, contained)",
    "reward.functions[].weight": "weight in the scalar reward",
    "reward.functions[].kwargs": "extra keyword arguments of a python / math_verify function",
    "reward.functions[].correct": "this reward is the correctness check of the accuracy metrics (value >= 1 = correct); required on one entry when there are several",
}

# Lists whose items are documented as their own tables.
LIST_ITEMS: dict[str, type] = {"reward.functions": C.RewardFunctionConfig}
try:  # the faults section (megarl.faults) may be absent in a partial checkout; it documents its keys
    from megarl.faults.config import FIELD_MEANINGS, InjectionConfig

    LIST_ITEMS["faults.inject"] = InjectionConfig
    MEANINGS.update(FIELD_MEANINGS)
except ImportError:  # pragma: no cover
    pass


def _comments(cls: type) -> dict[str, str]:
    """Field name -> its inline ``# comment`` or the ``#`` lines just above it in the class source."""
    out: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        s = line.strip()
        if s.startswith("#"):
            above.append(s.lstrip("#").strip())
            continue
        m = re.match(r"(\w+)\s*:\s*[^#]*?(?:#\s*(.*))?$", s)
        if m and not s.startswith(("def ", "class ", "@", '"""', "return")):
            text = m.group(2) or " ".join(above)
            if text:
                out[m.group(1)] = text
        above = []
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        v = f.default_factory()  # type: ignore[misc]
        return "(see below)" if dataclasses.is_dataclass(v) else v
    return "(required)"


def _fmt_default(v: Any) -> str:
    if isinstance(v, str) and v == "(see below)":
        return v
    if dataclasses.is_dataclass(v):
        return "(see below)"
    if isinstance(v, list) and v and dataclasses.is_dataclass(v[0]):
        return f"{len(v)} item(s): " + "; ".join(
            ", ".join(f"{k}={x!r}" for k, x in dataclasses.asdict(i).items() if x not in (None, {}, []))
            for i in v
        )
    text = "null" if v is None else ("true" if v is True else ("false" if v is False else repr(v)))
    return f"`{text}`".replace("|", "\\|")


def rows(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, meaning) of every leaf field of ``cls`` (nested sections flattened)."""
    hints = typing.get_type_hints(cls)
    comments = _comments(cls)
    out = []
    for f in C.yaml_fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += rows(tp, key + ".")
            continue
        meaning = comments.get(f.name) or MEANINGS.get(key, "")
        out.append((key, type_name(tp), _fmt_default(_default(f)), meaning))
    return out


def _section_doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    return " ".join(doc.split("\n\n")[0].split())


def chosen_rows(section: str, cls: type) -> list[tuple[str, str, str, str]]:
    """The rows of the keys that choices of ``section``'s selector contribute (its ``CHOSEN_BY``
    field; megarl/plugin/config_parts.py ``register_keys``), each meaning led by its choice."""
    from megarl.plugin.config_parts import KEYS

    if not any(f.metadata.get(C.CHOSEN_BY) for f in dataclasses.fields(cls)):
        return []
    return [
        (key, tp, default, f"{choice}: {meaning}" if meaning else "")
        for choice, part in sorted(KEYS.get(section, {}).items())  # not in import order
        for key, tp, default, meaning in rows(part.schema, section + ".")
    ]


def contributed_sections() -> dict[str, type]:
    """Name -> dataclass of the sections other packages contribute (megarl/plugin/config_parts.py)."""
    from megarl.catalogue import load_config_parts
    from megarl.plugin.config_parts import SECTIONS

    load_config_parts()
    return {name: SECTIONS[name].schema for name in sorted(SECTIONS)}  # not in import order


def missing_meanings() -> list[str]:
    """Keys that have neither a comment nor a ``MEANINGS`` entry."""
    missing = []
    for name, cls in contributed_sections().items():
        missing += [r[0] for r in rows(cls, name + ".") + chosen_rows(name, cls) if not r[3]]
    for f in C.yaml_fields(C.TrainConfig):
        tp = typing.get_type_hints(C.TrainConfig)[f.name]
        if not dataclasses.is_dataclass(tp):
            missing += [] if MEANINGS.get(f.name) else [f.name]
            continue
        missing += [r[0] for r in rows(tp, f.name + ".") + chosen_rows(f.name, tp) if not r[3]]
    for key, item in LIST_ITEMS.items():
        missing += [r[0] for r in rows(item, key + "[].") if not r[3]]
    return missing


def render() -> str:
    """The whole of docs/configuration.md."""
    hints = typing.get_type_hints(C.TrainConfig)
    intro = (
        "Every section and key of a `megarl train` config, with its type, default and meaning. "
        "Generated from the dataclasses in `megarl/trainer/config_sections.py` (and the sections they reuse, "
        "and the sections and keys other packages contribute through `megarl/plugin/config_parts.py`) by "
        "`python -m megarl.trainer.config_docs > docs/configuration.md`; a test keeps it in sync."
    )
    usage = (
        "Keys are written as in the YAML (`section.key`) or as `section.key=value` overrides on the command "
        "line. Unknown keys, wrong types and numbers outside the `allowed` range fail at start with one "
        "message naming the key and what is allowed; `Literal` types list the allowed values. A number in "
        "scientific notation (`1e-4`, which YAML reads as a string) is read as a number for number keys. `advantage:` takes the estimator's own knobs beside `estimator` "
        "(checked against its signature)."
    )
    from megarl.trainer.config_layers import docs_section

    out = ["# Configuration reference", "", intro, "", usage, "", *docs_section()]
    contributed = contributed_sections()
    sections: list[tuple[str, Any, dataclasses.Field | None, str]]
    sections = [(f.name, hints[f.name], f, "") for f in C.yaml_fields(C.TrainConfig)]
    for name, cls in contributed.items():
        owner = f"Contributed by `{cls.__module__}` (megarl/plugin/config_parts.py)."
        sections.append((name, cls, None, owner))
    for name, cls, f, owner in sections:
        if f is None:  # a contributed section
            out += [f"## `{name}`", "", _section_doc(cls), "", owner, ""]
            out += _table(rows(cls, name + "."))
            continue
        if not dataclasses.is_dataclass(cls):  # a free-form section, checked by the parts it configures
            out += [
                f"## `{f.name}`",
                "",
                MEANINGS[f.name] + ".",
                "",
                "| key | type | allowed | default | meaning |",
                "|---|---|---|---|---|",
                f"| `{f.name}` | {type_name(cls)} | | {_fmt_default(_default(f))} | {MEANINGS[f.name]} |",
                "",
            ]
            continue
        out += [f"## `{f.name}`", "", _section_doc(cls), ""]
        if f.name == "environment":  # the workflows' own descriptions live with them
            from megarl.rollout.workflow import WORKFLOW_DOCS

            out += [*(f"- `{k}`: {v}" for k, v in WORKFLOW_DOCS.items()), ""]
        out += _table(rows(cls, f.name + ".") + chosen_rows(f.name, cls))[:-1]
        for lkey, item in LIST_ITEMS.items():
            if lkey.startswith(f.name + "."):
                out += ["", f"Each item of `{lkey}`: {_section_doc(item)}", ""]
                out += _table(rows(item, lkey + "[]."))[:-1]
        out.append("")
    from megarl.trainer.threads import ENV_DOC

    out += ENV_DOC + _removed_keys()
    return "\n".join(out)


def _table(entries: list[tuple[str, str, str, str]]) -> list[str]:
    """The markdown table of ``rows`` entries, then an empty line."""
    out = ["| key | type | allowed | default | meaning |", "|---|---|---|---|---|"]
    out += [
        f"| `{key}` | {tp} | {range_text(key)} | {default} | {meaning} |"
        for key, tp, default, meaning in entries
    ]
    return out + [""]


def _removed_keys() -> list[str]:
    """The table of keys older configs used and where they went (``config_migrations.MOVED``)."""
    out = [
        "## Removed sections",
        "",
        "A config that still has one of these sections is refused with a message naming the new key of "
        "each of its keys.",
        "",
        "| old key | new key |",
        "|---|---|",
    ]
    out += [f"| `{old}` | `{new}` |" for old, new in moved_keys().items()]
    return out + [""]


if __name__ == "__main__":
    print(render(), end="")
