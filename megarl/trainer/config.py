"""The typed run configuration of ``megarl train``: dataclasses loaded from YAML plus ``key=value`` overrides.

Every section is a dataclass (``config_sections``); loading (``config_loading``) checks every key
against the dataclass fields and every value against the field's type (``Literal`` fields list their
allowed values), so a typo or a wrong type fails at start with one message naming the dotted key.
``validate`` (``config_checks``) then checks sizes, part names and knobs, and ``check_layout`` the
parallel layout against the model's shapes and the world size. ``save_resolved`` writes the fully
resolved config (defaults filled in) into the run directory. This module re-exports what callers use.
"""

from __future__ import annotations

from megarl.trainer.config_checks import check_layout, method_knobs, method_of, validate
from megarl.trainer.config_loading import (
    apply_overrides,
    from_dict,
    load_config,
    save_resolved,
    to_dict,
)
from megarl.trainer.config_sections import (
    ConfigError,
    RewardConfig,
    RewardFunctionConfig,
    TrainConfig,
)

__all__ = [
    "ConfigError",
    "RewardConfig",
    "RewardFunctionConfig",
    "TrainConfig",
    "apply_overrides",
    "check_layout",
    "from_dict",
    "load_config",
    "method_knobs",
    "method_of",
    "save_resolved",
    "to_dict",
    "validate",
]
