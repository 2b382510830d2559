"""The sections of the ``megarl train`` config: one dataclass per YAML section (``TrainConfig`` holds
them all, with the sections other packages contribute in ``TrainConfig.sections``). Plain data
with no torch import, so a config is built and range-checked before anything heavy loads; loading
lives in ``config_loading``, the checks in ``config_checks``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.faults.config import FaultsConfig, InjectionConfig
from megarl.learner.optim_config import OptimConfig
from megarl.objectives.objective_config import ObjectiveConfig

# the learner's own optimizer settings are the `optimizer` section (one definition, megatron-free)
OptimizerConfig = OptimConfig


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the dotted key and what is allowed."""


# field metadata: the field holds contributed sections (``CONTRIBUTED``) or the keys a selector's
# choice contributes (``CHOSEN_BY``: the selector field); neither is a YAML key itself
CONTRIBUTED = "contributed"
CHOSEN_BY = "chosen_by"


def yaml_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a section that are YAML keys (not the holders of contributed keys)."""
    return [
        f for f in dataclasses.fields(cls) if not (f.metadata.get(CONTRIBUTED) or f.metadata.get(CHOSEN_BY))
    ]


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
    # training output layer fused with the logprob/entropy op, so the [T, V] logits never exist
    # (docs/learner.md): auto = wherever the objective reads only per-token logprobs and entropies;
    # on = also, refusing (naming why) where it cannot; off = always the full logits
    fused_output: Literal["auto", "on", "off"] = "auto"


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
    and reload weights from disk or in memory (see ``weight_sync``)."""

    engine: Literal["embedded", "vllm", "sglang"] = "embedded"
    urls: list = field(default_factory=list)
    # urls: the servers' keys, a JSON file {"api_key", "admin_key"} of mode 0600 (else the environment:
    # MEGARL_ROLLOUT_KEY_FILE, or MEGARL_ROLLOUT_API_KEY + MEGARL_ROLLOUT_ADMIN_KEY; docs/trainer.md)
    key_file: str | None = None
    n: int = 8  # samples per prompt (the group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    max_concurrency: int = 64
    # embedded engine: samples decoding together at most; 1 = one request at a time (bitwise
    # reproducible across runs: a batch's composition moves logprobs in their last bits)
    embedded_batch_rows: int = 1024
    weights_dir: str | None = None  # server engines: where exported weights go (default run_dir/weights)
    # how weights reach the servers. disk: an exported HF checkpoint the servers reload;
    # memory: the tensors sent over a torch.distributed group to the servers' workers (vLLM: needs
    # megarl's weight receiver, which rollout.launch adds; SGLang: its own weight-update group, gloo
    # on CPU, NCCL on GPU); auto: memory with rollout.launch, else disk
    weight_sync: Literal["auto", "disk", "memory"] = "auto"
    # vllm / sglang: start one server on this node (from the engine's venv) serving the initial policy
    launch: bool = False
    server_python: str | None = None  # launch: the server venv's python (default: .venv-vllm / .venv-sglang)
    server_dtype: Literal["float32", "bfloat16"] = "float32"  # launch: the server's dtype
    server_max_num_seqs: int = 16  # launch: vLLM --max-num-seqs (SGLang on CPU: KV cache for as many)
    server_startup_timeout_s: float = 600.0  # launch: how long to wait for /health
    server_args: list = field(default_factory=list)  # launch: extra server command-line arguments
    # launch, sglang: the server's device ("cpu": SGLang's CPU engine, the venv of tests/setup/40-sglang.sh;
    # None: SGLang's default, CUDA)
    server_device: Literal["cpu", "cuda"] | None = None


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
    # wrap the rendered prompt as a user message with the HF tokenizer's chat template
    chat_template: bool = False
    system_prompt: str | None = None  # chat_template: an optional system message before the user message
    on_bad_row: Literal["fatal", "skip"] = "fatal"
    max_bad_rows: int = 10  # with on_bad_row=skip: more bad rows than this is fatal
    generate: dict | None = None  # {task: reverse|add|copy|grid, ...} see megarl.data.tasks


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
class EnvironmentConfig:
    """The rollout workflow: ``name`` picks one of megarl/rollout/workflow.py ``WORKFLOWS`` (``none``:
    one answer per sample); the other keys are that workflow's settings, each documented with the
    workflow in docs/agents.md and docs/configuration.md. A workflow may declare keys of its own
    (megarl/plugin/config_parts.py ``register_keys``), written beside these and allowed only with
    that ``name``."""

    name: str = "none"  # a WORKFLOWS name (megarl/rollout/workflow.py)
    max_turns: int = 2  # answers per sample at most
    feedback: str = " {prompt}"  # the text sent after a wrong answer (template over {prompt})
    # the chosen workflow's own keys (its dataclass; no YAML key of its own)
    chosen: Any = field(default=None, metadata={CHOSEN_BY: "name"})


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
    """Atomic checkpoints under ``run_dir/checkpoints``; ``resume: auto`` continues from the newest
    complete one of the run in ``logging.run_dir``, ``never`` starts a new run (see ``on_existing``)."""

    every: int = 10
    keep_last: int = 2
    resume: Literal["auto", "never"] = "auto"
    # resume: never into a run_dir that holds a run: refuse (default), archive (move its contents to
    # <run_dir>.archived-<old run id>) or overwrite (delete them)
    on_existing: Literal["refuse", "archive", "overwrite"] = "refuse"


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
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    async_loop: AsyncLoopConfig = field(default_factory=AsyncLoopConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)  # docs/faults.md
    # the sections other packages contribute (name -> the owner's dataclass; no YAML key of its own):
    # read them with megarl.plugin.config_parts.section_of
    sections: dict = field(default_factory=dict, metadata={CONTRIBUTED: True})


# Lists whose items are sections themselves.
LIST_ITEM_TYPES = {("reward", "functions"): RewardFunctionConfig, ("faults", "inject"): InjectionConfig}
