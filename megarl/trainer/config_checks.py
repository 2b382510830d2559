"""Checks of a loaded ``megarl train`` config that the types alone cannot make: sizes, part names
and their knobs (``validate``, run by every load) and the parallel layout against the model's shapes
and the world size (``check_layout``, at setup).
"""

from __future__ import annotations

import json
from pathlib import Path

from megarl.faults.config import validate_faults
from megarl.rewards.correctness import correctness_index
from megarl.trainer.config_ranges import check_ranges, contributed_parts
from megarl.trainer.config_sections import ConfigError, TrainConfig


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks that need no model: ranges, sizes, part names and their knobs."""
    check_ranges(cfg)  # plain arithmetic: before the part registries (and torch) are imported
    s, r = cfg.schedule, cfg.rollout
    if cfg.data.chat_template and cfg.model.tokenizer != "hf":
        raise ConfigError(
            "data.chat_template=true needs model.tokenizer='hf' (a tokenizer with a chat template)"
        )
    if s.mini_batches > s.prompts_per_step:
        raise ConfigError(
            f"schedule.mini_batches={s.mini_batches} must be <= schedule.prompts_per_step="
            f"{s.prompts_per_step} (mini-batches hold whole groups)"
        )
    from megarl.advantages import ADVANTAGE_ESTIMATORS
    from megarl.catalogue import load_builtin
    from megarl.plugin.knobs import check_call_knobs

    load_builtin()
    if cfg.advantage.estimator not in ADVANTAGE_ESTIMATORS:
        raise ConfigError(
            f"advantage.estimator={cfg.advantage.estimator!r}; allowed: "
            f"{', '.join(ADVANTAGE_ESTIMATORS.names())}"
        )
    if r.n < 2 and ADVANTAGE_ESTIMATORS.info(cfg.advantage.estimator).group_relative:
        raise ConfigError(
            f"rollout.n={r.n} with advantage.estimator={cfg.advantage.estimator!r}: the estimator is "
            "group-relative (each sample against the other samples of its prompt), so with one sample "
            "per prompt every advantage and gradient is 0; rollout.n must be >= 2"
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
    if r.launch and (r.engine not in ("vllm", "sglang") or r.urls):
        raise ConfigError(
            "rollout.launch=true starts one vLLM or SGLang server: it needs rollout.engine='vllm' or "
            "'sglang' and no rollout.urls"
        )
    if r.server_device is not None and not (r.launch and r.engine == "sglang"):
        raise ConfigError(
            "rollout.server_device is for a launched SGLang server (rollout.launch=true, engine: sglang)"
        )
    if r.weight_sync == "memory" and r.engine not in ("vllm", "sglang"):
        raise ConfigError(
            "rollout.weight_sync='memory' sends weights to vLLM or SGLang servers; "
            f"rollout.engine={r.engine!r} takes them in process: use weight_sync: disk (or auto)"
        )
    if r.weight_sync == "memory" and cfg.async_loop.enabled and cfg.async_loop.partial_rollout == "continue":
        raise ConfigError(
            "rollout.weight_sync='memory' cannot keep requests on the server across a reload "
            "(async_loop.partial_rollout='continue'): use partial_rollout: abort or weight_sync: disk"
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
    if cfg.environment.name not in WORKFLOWS:
        raise ConfigError(
            f"environment.name={cfg.environment.name!r}; allowed: {', '.join(WORKFLOWS.names())}"
        )
    _check_contributed(cfg)
    try:
        cfg.environment.feedback.format(prompt="")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(
            f"environment.feedback={cfg.environment.feedback!r}: only {{prompt}} may be used ({e!r})"
        ) from None
    try:
        spec = method_of(cfg)
        required_inputs(cfg, spec)
        check_inputs_section(cfg)
        method_knobs(cfg, spec)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_contributed(cfg: TrainConfig) -> None:
    """The checks of the contributed sections and of the chosen keys (megarl/plugin/config_parts.py)."""
    for _, part, _ in contributed_parts(cfg):
        if part.check is None:
            continue
        try:
            part.check(cfg)
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


def check_layout(cfg: TrainConfig, hf_config: dict, world_size: int | None) -> None:
    """Impossible layouts fail here, before any process group exists: TP must divide the heads, the
    KV heads and the vocabulary, EP the experts, PP the layers, and tp*pp*cp the world size
    (``world_size`` None: not known yet, e.g. ``megarl train --check``; those checks are skipped)."""
    p = cfg.parallel
    heads = int(hf_config.get("num_attention_heads", 0))
    kv = int(hf_config.get("num_key_value_heads") or heads)
    vocab = int(hf_config.get("vocab_size", 0))
    layers = int(hf_config.get("num_hidden_layers", 0))
    experts = int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)
    if heads % p.tp or kv % p.tp:
        # megatron-core also runs tp a multiple of the KV heads (each KV head replicated on tp/kv
        # ranks), but megarl's HF weight loading splits the KV heads over the TP ranks
        raise ConfigError(
            f"parallel.tp={p.tp} must divide num_attention_heads={heads} and "
            f"num_key_value_heads={kv}; allowed tp: {_divisors_of_both(heads, kv)} "
            "(the KV heads are split over the TP ranks, not replicated)"
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
    if world_size is None:
        return
    if p.world_size and p.world_size != world_size:
        raise ConfigError(f"parallel.world_size={p.world_size} but this job has {world_size} processes")
    mp = p.tp * p.pp * p.cp
    if world_size % mp:
        raise ConfigError(f"parallel: tp*pp*cp={mp} must divide the world size {world_size}")
    if cfg.schedule.prompts_per_step % max(world_size // mp, 1):
        raise ConfigError(
            f"schedule.prompts_per_step={cfg.schedule.prompts_per_step} must be divisible by the "
            f"data-parallel size {world_size // mp}"
        )


def layout_hf_config(cfg: TrainConfig) -> dict:
    """The model shapes ``check_layout`` reads, without torch: ``model.hf_dir``'s config.json or
    ``model.hf_config``, with the char tokenizer's vocabulary size when the config has none."""
    if cfg.model.hf_dir is not None:
        path = Path(cfg.model.hf_dir) / "config.json"
        try:
            hf = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.hf_dir: cannot read {path}: {e}") from None
    else:
        hf = dict(cfg.model.hf_config)
    if cfg.model.tokenizer == "char" and "vocab_size" not in hf:
        from megarl.data.tokenizer import CharTokenizer

        hf["vocab_size"] = CharTokenizer(cfg.model.alphabet).vocab_size
    return hf


def _divisors_of_both(a: int, b: int) -> str:
    return ", ".join(str(d) for d in range(1, max(a, 1) + 1) if a % d == 0 and b % d == 0)
