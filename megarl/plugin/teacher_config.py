"""The ``teacher`` config section: the model whose logprobs fill the teacher batch inputs
(megarl/plugin/core_inputs.py, megarl/plugin/engine_teacher.py), contributed to the ``megarl train``
config through megarl/plugin/config_parts.py. Code reads it with ``teacher_config(cfg)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.plugin.config_parts import POSITIVE, register_section, section_of


@dataclass
class TeacherConfig:
    """The teacher of on-policy distillation (``objective.distill``); its logprobs of the sampled
    tokens fill ``batch.teacher_logprobs`` (docs/distillation.md). ``source: megatron``: the HF
    checkpoint ``hf_dir`` (sharing the policy's vocabulary) run forward-only beside the learner
    under the run's layout. ``source: engine``: a rollout engine serving the teacher scores the
    student's tokens (``engine: vllm`` / ``sglang`` servers at ``urls``, keys from ``key_file``;
    ``embedded``: ``hf_dir`` in rank 0's process)."""

    hf_dir: str | None = None  # the teacher's HF checkpoint directory (config.json + safetensors)
    source: Literal["megatron", "engine"] = "megatron"  # who computes the teacher's logprobs
    engine: Literal["vllm", "sglang", "embedded"] = "vllm"  # source: engine
    urls: list = field(default_factory=list)  # source: engine, vllm/sglang: the teacher's servers
    model: str = "teacher"  # vLLM's --served-model-name of the teacher
    key_file: str | None = None  # JSON {"api_key", "admin_key"} of the teacher's servers (mode 0600)
    max_concurrency: int = 16  # scoring requests in flight per teacher server


def teacher_config(cfg: Any) -> TeacherConfig:
    """The run config's ``teacher`` section."""
    return section_of(cfg, "teacher", TeacherConfig)


def check_teacher(cfg: Any) -> None:
    """An engine-served teacher names its servers (``teacher.urls``; the embedded engine's
    checkpoint, ``teacher.hf_dir``, is checked when the run builds it, as the Megatron teacher's is)
    and cannot feed the full-vocabulary distillation modes (they need the teacher's logits)."""
    from megarl.objectives.distillation import DISTILLATION

    t, d = teacher_config(cfg), cfg.objective.distill
    if t.source != "engine":
        return
    if d in DISTILLATION.names() and "teacher_logits" in DISTILLATION.info(d).batch_inputs:
        raise ValueError(
            f"objective.distill={d!r} needs the teacher's full-vocabulary logits, which only "
            "teacher.source=megatron gives (an engine gives logprobs and top-K)"
        )
    if t.engine != "embedded" and not t.urls:
        raise ValueError(f"teacher.source=engine with teacher.engine={t.engine} needs teacher.urls")


register_section("teacher", TeacherConfig, check=check_teacher, ranges={"max_concurrency": POSITIVE})
