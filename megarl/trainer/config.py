"""The typed run configuration of ``megarl train``: dataclasses loaded from YAML plus ``key=value`` overrides.

Every section is a dataclass; loading checks every key against the dataclass fields and every value
against the field's type (``Literal`` fields list their allowed values), so a typo or a wrong type
fails at start with one message naming the dotted key. ``check_layout`` then checks the parallel
layout against the model's shapes and the world size. ``save_resolved`` writes the fully resolved
config (defaults filled in) into the run directory.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megarl.faults.config import FaultsConfig, InjectionConfig, validate_faults
from megarl.learner.optim_config import OptimConfig
from megarl.objectives.rl_objective import ObjectiveConfig
from megarl.rewards.correctness import correctness_index

# the learner's own optimizer settings are the `optimizer` section (one definition, megatron-free)
OptimizerConfig = OptimConfig


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the dotted key and what is allowed."""


# ----------------------------------------------------------------------------------------- sections
@dataclass
class ModelConfig:
    """The policy model. ``hf_dir``: start from a HF checkpoint (config + safetensors); else a model
    is built with random weights from ``hf_config`` (a HF config dict, e.g. a tiny Qwen3)."""

    hf_dir: str | None = None
    hf_config: dict = field(default_factory=dict)
    tokenizer: Literal["char", "hf"] = "char"  # char: megarl.data.tokenizer.CharTokenizer over `alphabet`
    alphabet: str = "0123456789+-=*/ ()"
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 1234


@dataclass
class ParallelConfig:
    """Learner layout; DP = world_size / (tp * pp * cp). ``world_size`` 0 = take it from torchrun."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    expert_tp: int | None = None
    world_size: int = 0


@dataclass
class RolloutConfig:
    """How responses are sampled. ``engine: embedded`` generates in this process with the current
    weights (synced in memory after every step); ``vllm`` / ``sglang`` talk to servers at ``urls``
    and reload weights from disk."""

    engine: Literal["embedded", "vllm", "sglang"] = "embedded"
    urls: list = field(default_factory=list)
    n: int = 8  # samples per prompt (the group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    max_concurrency: int = 64
    weights_dir: str | None = None  # server engines: where exported weights go (default run_dir/weights)
    launch: bool = False  # vllm: start one server on this node (vLLM venv) serving the initial policy
    server_python: str | None = None  # launch: the vLLM venv's python (default: .venv-vllm)
    server_dtype: Literal["float32", "bfloat16"] = "float32"  # launch: the server's dtype
    server_max_num_seqs: int = 16  # launch: vLLM --max-num-seqs
    server_startup_timeout_s: float = 600.0  # launch: how long to wait for /health
    server_args: list = field(default_factory=list)  # launch: extra vLLM command-line arguments


@dataclass
class DataConfig:
    """Prompt datasets (jsonl or parquet; a path or a glob). ``generate`` writes a synthetic task dataset
    first when the files do not exist (the quickstart's data)."""

    train: str = ""
    eval: str = ""
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    task_field: str = "task"
    prompt_template: str = "{prompt}"
    # wrap the rendered prompt as a user turn with the HF tokenizer's chat template
    chat_template: bool = False
    system_prompt: str | None = None  # chat_template: an optional system turn before the user turn
    on_bad_row: Literal["fatal", "skip"] = "fatal"
    max_bad_rows: int = 10  # with on_bad_row=skip: more bad rows than this is fatal
    generate: dict | None = None  # {task: reverse|add|copy, ...} see megarl.data.tasks


@dataclass
class RewardFunctionConfig:
    """One named reward dimension. ``kind``: exact_match | regex | math_verify (the ``math-verify``
    package: the response's final answer equals the ground truth mathematically) | python
    (``function`` = "module:name"). math_verify and python run in a contained worker process.
    ``correct``: this reward is the correctness check (a value >= 1 is a correct answer); accuracy
    metrics use it. Required on one entry when there are several (megarl/rewards/correctness.py)."""

    name: str = "correct"
    kind: Literal["exact_match", "regex", "math_verify", "python"] = "exact_match"
    weight: float = 1.0
    pattern: str | None = None  # regex: a match (with the answer substituted for {answer}) = 1
    function: str | None = None  # python: "package.module:function"
    kwargs: dict = field(default_factory=dict)
    correct: bool = False  # the correctness check (accuracy metrics); one entry when there are several


@dataclass
class JudgeConfig:
    """LLM-judge calls of judged reward shapers (those that declare ``needs_judge``) through the
    rollout engine: each call
    is bounded by ``timeout_s``; failed or malformed replies are contained and counted."""

    timeout_s: float = 30.0
    max_new_tokens: int = 16
    temperature: float = 0.0


@dataclass
class RewardConfig:
    """Reward dimensions; the scalar reward is their weighted sum. A python reward function that
    raises or runs past ``timeout_s`` gets ``fallback`` and is counted in the metrics.
    ``shaping``: an optional reward shaper ``{name: <REWARD_SHAPERS key>, <knobs>}`` applied to the
    rewards of every rollout round (megarl/rewards/shaping/processor.py)."""

    functions: list = field(default_factory=lambda: [RewardFunctionConfig()])
    timeout_s: float = 5.0
    fallback: float = 0.0
    shaping: dict | None = None
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class AdvantageConfig:
    """Advantage estimator (registry name) and its knobs (keyword arguments of the estimator)."""

    estimator: str = "grpo"
    knobs: dict = field(default_factory=dict)


@dataclass
class TeacherConfig:
    """The teacher of on-policy distillation (``objective.distill: sampled_reverse_kl``): a HF
    checkpoint sharing the policy's vocabulary, run forward-only beside the learner; its logprobs of
    the sampled tokens fill ``batch.teacher_logprobs``."""

    hf_dir: str | None = None  # the teacher's HF checkpoint directory (config.json + safetensors)


@dataclass
class EnvironmentConfig:
    """The rollout workflow (megarl/rollout/workflow.py ``WORKFLOWS``). ``none``: one answer per
    sample. ``retry``: a wrong answer gets ``feedback`` (a ``str.format`` template over ``prompt``)
    as an observation and another turn, up to ``max_turns``; the episode's outcome is its last
    answer's reward."""

    name: str = "none"  # a WORKFLOWS name: none (single-turn), retry (a wrong answer gets another turn)
    max_turns: int = 2  # answers per episode at most
    feedback: str = " {prompt}"  # the observation after a wrong answer (template over {prompt})


@dataclass
class SamplingConfig:
    """DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts until
    the batch holds ``schedule.prompts_per_step`` informative groups or ``max_rounds`` is reached."""

    dynamic: bool = False
    max_rounds: int = 3


@dataclass
class WarmupConfig:
    """Supervised warm-up on the dataset's answers before RL (so rewards are not all zero at start).
    The warmed-up weights are the RL initial policy and the KL reference."""

    sft_steps: int = 0
    batch_size: int = 64
    lr: float = 1e-3


@dataclass
class ScheduleConfig:
    """Loop sizes. Each RL step: ``prompts_per_step`` prompts x ``rollout.n`` samples, then
    ``ppo_epochs`` passes of ``mini_batches`` optimizer steps, each over ``micro_batches``."""

    steps: int = 100
    prompts_per_step: int = 16
    ppo_epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    eval_every: int = 0  # 0 = only before and after training
    eval_samples: int = 64  # held-out prompts per evaluation
    eval_k: int = 4  # pass@k with k samples at rollout.temperature (1 = greedy pass@1 only)
    seed: int = 1234


@dataclass
class CheckpointConfig:
    """Atomic checkpoints under ``run_dir/checkpoints``; ``resume: auto`` continues from the newest."""

    every: int = 10
    keep_last: int = 2
    resume: Literal["auto", "never"] = "auto"


@dataclass
class LoggingConfig:
    """Run directory, metrics.jsonl, optional tensorboard/wandb and the end-of-run plot."""

    run_dir: str = "runs/default"
    print_every: int = 1
    tensorboard: bool = False  # event files in run_dir/tensorboard (the `tensorboard` package)
    wandb: bool = False  # log to Weights & Biases when the wandb package is installed (never required)
    wandb_project: str = "megarl"
    # auto: a live bar on a terminal, plain lines otherwise
    progress: Literal["auto", "bar", "lines"] = "auto"
    plot: bool = True


@dataclass
class AsyncLoopConfig:
    """Asynchronous rollouts with bounded staleness (``megarl.trainer.async_loop``).

    Rank 0 generates the rollouts of the next steps in a background thread while the learner trains.
    A sample's staleness is (the learner's version when it trains on it) - (the version that
    generated it); the producer never starts a step's rollouts more than ``max_staleness`` versions
    ahead, and a group found older than that when consumed is dropped or regenerated (``on_stale``).
    At a weight update the in-flight requests are aborted; ``partial_rollout: abort`` regenerates
    them from scratch with the new weights, ``continue`` keeps the tokens generated so far and
    continues them with the new weights (the sample's version is its oldest part's)."""

    enabled: bool = False
    max_staleness: int = 1
    partial_rollout: Literal["abort", "continue"] = "abort"
    on_stale: Literal["drop", "regenerate"] = "regenerate"


@dataclass
class TrainConfig:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    method: dict | None = None  # {name: <built-in method>} or {import: "pkg.module:SPEC"}, plus its knobs
    inputs: dict = field(
        default_factory=dict
    )  # knobs of batch-input providers: {<input name>: {<knob>: value}}
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    async_loop: AsyncLoopConfig = field(default_factory=AsyncLoopConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)  # docs/faults.md


# Lists whose items are sections themselves.
_LIST_ITEM_TYPES = {("reward", "functions"): RewardFunctionConfig, ("faults", "inject"): InjectionConfig}


# ----------------------------------------------------------------------------------------- loading
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r}; allowed: {', '.join(repr(a) for a in allowed)}")
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for alt in typing.get_args(tp):
            if alt is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, alt, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}={value!r} must be {_type_name(tp)}")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number (YAML reads 1e-3 as a string: write 1.0e-3)")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string")
        return value
    if tp in (dict,) or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping")
        return dict(value)
    if tp in (list,) or origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a list")
        return list(value)
    raise ConfigError(f"{key}: unsupported type {tp}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    """A dataclass ``cls`` from a mapping, every key and value checked."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown key {where}{unknown[0]}; allowed in {prefix or 'the top level'}: {', '.join(names)}"
        )
    kw = {}
    for name in names:
        if name not in data:
            continue
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        v = data[name]
        if dataclasses.is_dataclass(tp):
            kw[name] = _build(tp, v, key)
        elif (prefix, name) in _LIST_ITEM_TYPES:
            items = _coerce(v, list, key)
            kw[name] = [
                _build(_LIST_ITEM_TYPES[(prefix, name)], it, f"{key}[{i}]") for i, it in enumerate(items)
            ]
        else:
            kw[name] = _coerce(v, tp, key)
    return cls(**kw)


def _advantage_from_yaml(d: Any) -> dict:
    """The core example files write estimator knobs next to ``estimator``; fold them into ``knobs``."""
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"advantage must be a mapping, got {type(d).__name__}")
    d = dict(d)
    knobs = dict(d.pop("knobs", None) or {})
    est = d.pop("estimator", "grpo")
    knobs.update(d)
    return {"estimator": est, "knobs": knobs}


def from_dict(data: dict) -> TrainConfig:
    """A validated ``TrainConfig`` from a plain dict (the parsed YAML)."""
    if not isinstance(data, dict):
        raise ConfigError(f"the config must be a mapping of sections, got {type(data).__name__}")
    data = dict(data)
    if data.get("method") is not None:
        data = _with_method_defaults(data)
    if "advantage" in data:
        data["advantage"] = _advantage_from_yaml(data["advantage"])
    cfg = _build(TrainConfig, data, "")
    validate(cfg)
    return cfg


def _with_method_defaults(data: dict) -> dict:
    """The method's config sections under the user's: a key the user sets wins, a key left unset
    takes the method's own default (``MethodSpec.config``)."""
    from megarl.catalogue import method_spec

    section = data["method"]
    if not isinstance(section, dict):
        raise ConfigError(f"method must be a mapping with 'name' or 'import', got {section!r}")
    try:
        spec = method_spec(section)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return _merge_defaults(spec.config, data)


def _merge_defaults(defaults: dict, data: dict) -> dict:
    out = dict(data)
    for k, v in defaults.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge_defaults(v, out[k])
        elif out.get(k) is None:
            out[k] = v
    return out


def _parse_override_value(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``section.key=value`` strings (values parsed as YAML) to the raw config dict."""
    data = dict(data or {})
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} must look like section.key=value")
        key, text = ov.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {ov!r}: empty key part")
        node = data
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(f"override {ov!r}: {p} is not a section")
            node[p] = dict(nxt)
            node = node[p]
        node[parts[-1]] = _parse_override_value(text)
    return data


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> TrainConfig:
    """Read the YAML file, apply overrides and validate. Relative data paths stay relative to the cwd."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    return from_dict(apply_overrides(data, overrides or []))


# ----------------------------------------------------------------------------------------- checks
def _positive(key: str, v: float, strict: bool = True) -> None:
    if (v <= 0) if strict else (v < 0):
        raise ConfigError(f"{key}={v} must be {'> 0' if strict else '>= 0'}")


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks that need no model: sizes, part names and their knobs."""
    from megarl.advantages import ADVANTAGE_ESTIMATORS
    from megarl.catalogue import load_builtin
    from megarl.plugin.knobs import check_call_knobs

    load_builtin()

    s, r = cfg.schedule, cfg.rollout
    for key, v in (
        ("schedule.steps", s.steps),
        ("schedule.prompts_per_step", s.prompts_per_step),
        ("schedule.ppo_epochs", s.ppo_epochs),
        ("schedule.mini_batches", s.mini_batches),
        ("schedule.micro_batches", s.micro_batches),
        ("rollout.n", r.n),
        ("rollout.max_new_tokens", r.max_new_tokens),
        ("checkpoint.every", cfg.checkpoint.every),
        ("checkpoint.keep_last", cfg.checkpoint.keep_last),
        ("sampling.max_rounds", cfg.sampling.max_rounds),
        ("logging.print_every", cfg.logging.print_every),
        ("schedule.eval_k", s.eval_k),
    ):
        _positive(key, v)
    _positive("warmup.sft_steps", cfg.warmup.sft_steps, strict=False)
    _positive("async_loop.max_staleness", cfg.async_loop.max_staleness, strict=False)
    if cfg.data.chat_template and cfg.model.tokenizer != "hf":
        raise ConfigError(
            "data.chat_template=true needs model.tokenizer='hf' (a tokenizer with a chat template)"
        )
    _positive("reward.timeout_s", cfg.reward.timeout_s)
    _positive("rollout.temperature", r.temperature, strict=False)
    if s.mini_batches > s.prompts_per_step:
        raise ConfigError(
            f"schedule.mini_batches={s.mini_batches} must be <= schedule.prompts_per_step="
            f"{s.prompts_per_step} (mini-batches hold whole groups)"
        )
    if cfg.advantage.estimator not in ADVANTAGE_ESTIMATORS:
        raise ConfigError(
            f"advantage.estimator={cfg.advantage.estimator!r}; allowed: "
            f"{', '.join(ADVANTAGE_ESTIMATORS.names())}"
        )
    fn = ADVANTAGE_ESTIMATORS.get(cfg.advantage.estimator)
    try:
        check_call_knobs(
            fn,
            cfg.advantage.knobs,
            "advantage",
            f"estimator {cfg.advantage.estimator!r}",
            skip=("batch",),
            also_allowed=("estimator",),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        cfg.objective.validate()
        validate_faults(cfg.faults)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if r.engine != "embedded" and not r.urls and not r.launch:
        raise ConfigError(
            f"rollout.engine={r.engine!r} needs rollout.urls (the servers' base URLs) or rollout.launch=true"
        )
    if r.launch and (r.engine != "vllm" or r.urls):
        raise ConfigError(
            "rollout.launch=true starts one vLLM server: it needs rollout.engine='vllm' and no rollout.urls"
        )
    if not cfg.data.train and not cfg.data.generate:
        raise ConfigError("data.train is empty: give a jsonl path/glob or data.generate")
    if not cfg.reward.functions:
        raise ConfigError("reward.functions is empty: give at least one reward dimension")
    names = [f.name for f in cfg.reward.functions]
    if len(set(names)) != len(names):
        raise ConfigError(f"reward.functions: names must be unique, got {names}")
    for i, f in enumerate(cfg.reward.functions):
        if f.kind == "regex" and not f.pattern:
            raise ConfigError(f"reward.functions[{i}].pattern is required for kind 'regex'")
        if f.kind == "python" and (not f.function or ":" not in f.function):
            raise ConfigError(
                f"reward.functions[{i}].function must be 'module:function' for kind 'python', "
                f"got {f.function!r}"
            )
    try:
        correctness_index(cfg.reward.functions)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_method_inputs(cfg)
    if cfg.model.hf_dir is None and not cfg.model.hf_config:
        raise ConfigError(
            "model: give model.hf_dir (a HF checkpoint) or model.hf_config (built with random weights)"
        )
    if cfg.objective.kl_coef and cfg.warmup.sft_steps == 0 and cfg.model.hf_dir is None:
        pass  # the reference is the random initial model: allowed, if odd


def _check_method_inputs(cfg: TrainConfig) -> None:
    """``reward.shaping`` (knobs checked by the shaper's signature), the judge, the workflow, the
    ``inputs`` section (each provider checks its own knobs) and the ``method`` section's knobs."""
    from megarl.rewards.shaping import build_reward_shaping
    from megarl.rollout.workflow import WORKFLOWS
    from megarl.trainer.method_runtime import check_inputs_section, required_inputs

    if cfg.reward.shaping is not None:
        try:
            build_reward_shaping({"shaping": cfg.reward.shaping})
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e) if "reward.shaping" in str(e) else f"reward.shaping: {e}") from None
    _positive("reward.judge.timeout_s", cfg.reward.judge.timeout_s)
    _positive("environment.max_turns", cfg.environment.max_turns)
    if cfg.environment.name not in WORKFLOWS:
        raise ConfigError(
            f"environment.name={cfg.environment.name!r}; allowed: {', '.join(WORKFLOWS.names())}"
        )
    d = cfg.objective.distill
    if d in ("forward_kl", "reverse_kl"):
        raise ConfigError(
            f"objective.distill={d!r} needs the teacher's full-vocabulary logits inside the loss, "
            "which the trainer does not provide yet; use sampled_reverse_kl (teacher logprobs)"
        )
    try:
        cfg.environment.feedback.format(prompt="")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(
            f"environment.feedback={cfg.environment.feedback!r}: only {{prompt}} may be used ({e!r})"
        ) from None
    _positive("reward.judge.max_new_tokens", cfg.reward.judge.max_new_tokens)
    try:
        spec = method_of(cfg)
        required_inputs(cfg, spec)
        check_inputs_section(cfg)
        method_knobs(cfg, spec)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def method_of(cfg: TrainConfig):
    """The run's ``MethodSpec`` (None when the config has no ``method`` section)."""
    from megarl.catalogue import method_spec

    return None if cfg.method is None else method_spec(cfg.method)


def method_knobs(cfg: TrainConfig, spec) -> object:
    """The method's knobs (the ``method`` section's keys other than ``name``/``import``), checked by
    the method's knobs dataclass."""
    from megarl.plugin.knobs import build_knobs

    if spec is None:
        return None
    raw = {k: v for k, v in cfg.method.items() if k not in ("name", "import")}
    return build_knobs(spec.knobs, raw, "method")


def check_layout(cfg: TrainConfig, hf_config: dict, world_size: int) -> None:
    """Impossible layouts fail here, before any process group exists: TP must divide the heads and
    the vocabulary, EP the experts, PP the layers, and tp*pp*cp the world size."""
    p = cfg.parallel
    for key in ("tp", "pp", "ep", "cp"):
        _positive(f"parallel.{key}", getattr(p, key))
    if p.world_size and p.world_size != world_size:
        raise ConfigError(f"parallel.world_size={p.world_size} but this job has {world_size} process(es)")
    mp = p.tp * p.pp * p.cp
    if world_size % mp:
        raise ConfigError(f"parallel: tp*pp*cp={mp} must divide the world size {world_size}")
    heads = int(hf_config.get("num_attention_heads", 0))
    kv = int(hf_config.get("num_key_value_heads") or heads)
    vocab = int(hf_config.get("vocab_size", 0))
    layers = int(hf_config.get("num_hidden_layers", 0))
    experts = int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)
    if heads % p.tp or kv % p.tp:
        raise ConfigError(
            f"parallel.tp={p.tp} must divide num_attention_heads={heads} and "
            f"num_key_value_heads={kv}; allowed tp: {_divisors_of_both(heads, kv)}"
        )
    if vocab % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} must divide vocab_size={vocab}")
    if layers % p.pp:
        raise ConfigError(
            f"parallel.pp={p.pp} must divide num_hidden_layers={layers}; allowed pp: "
            f"{_divisors_of_both(layers, layers)}"
        )
    if p.ep > 1 and (not experts or experts % p.ep):
        raise ConfigError(
            f"parallel.ep={p.ep} must divide num_experts={experts}"
            + (
                f"; allowed ep: {_divisors_of_both(experts, experts)}"
                if experts
                else " (a dense model needs ep=1)"
            )
        )
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1")
    if cfg.schedule.prompts_per_step % max(world_size // mp, 1):
        raise ConfigError(
            f"schedule.prompts_per_step={cfg.schedule.prompts_per_step} must be divisible by the "
            f"data-parallel size {world_size // mp}"
        )


def _divisors_of_both(a: int, b: int) -> str:
    return ", ".join(str(d) for d in range(1, max(a, 1) + 1) if a % d == 0 and b % d == 0)


def to_dict(cfg: TrainConfig) -> dict:
    """The resolved config as plain data (what ``save_resolved`` writes)."""
    d = dataclasses.asdict(cfg)
    adv = d.pop("advantage")
    d["advantage"] = {"estimator": adv["estimator"], **adv["knobs"]}
    return d


def save_resolved(cfg: TrainConfig, run_dir: str | os.PathLike) -> Path:
    """Write ``run_dir/config.resolved.yaml`` (every default filled in)."""
    out = Path(run_dir) / "config.resolved.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    os.replace(tmp, out)
    return out
