"""Known-harmless third-party warnings, silenced by exact message and module at CLI start.

Each entry names the message (a regex matched at the start of the text) and the module the warning is
attributed to; anything not listed stays visible. The list is what a CPU run of ``megarl train``
printed (megatron-core without Transformer Engine/Apex, torch.distributed's renamed collectives);
megarl's own warnings are fixed at their cause instead. Python's ``-W`` / ``PYTHONWARNINGS`` win: with
either set, nothing is filtered.
"""

from __future__ import annotations

import sys
import warnings

# (category, message regex, module regex): optional accelerator libraries absent on a CPU install
KNOWN: tuple[tuple[type[Warning], str, str], ...] = (
    (
        UserWarning,
        r"Transformer Engine and Apex are not installed\. Falling back to ",
        r"megatron\.core\.(optimizer(\.optimizer|\.clip_grads)?|distributed\.fsdp\.src\.megatron_fsdp\.mixed_precision)$|megatron_fsdp\.mixed_precision$",
    ),
    (
        UserWarning,
        r"Apex is not installed\. Falling back to Torch Norm$",
        r"megatron\.core\.models\.(backends|gpt\.gpt_layer_specs)$",
    ),
    # megatron's own default (cuda_graph_scope "full") trips its deprecation check; no CUDA graphs on CPU
    (
        UserWarning,
        r"full scope is deprecated\. Use empty cuda_graph_scope to capture the whole layer\.$",
        r"megatron\.core\.transformer\.transformer_config$",
    ),
    # on resume: megatron's checkpoint loader uses torch's old checkpoint API and ShardedTensor; the
    # ShardedTensor notice names its caller, which on CPU is the torch-function mode of the CPU shims
    (
        FutureWarning,
        r"`load_state_dict` is deprecated and will be removed in future versions\. "
        r"Please use `load` instead\.$",
        r"megatron\.core\.dist_checkpointing\.strategies\.torch$",
    ),
    (
        FutureWarning,
        r"Please use DTensor instead and we are deprecating ShardedTensor\.$",
        r"(megarl\.learner\.cpu_shims|megatron\.core\..*|torch\.distributed\..*)$",
    ),
    # megatron-core calls the old names of two collectives; torch keeps them working
    (
        FutureWarning,
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated\. "
        r"Please use `torch\.distributed\.(reduce_scatter_single|all_gather_single)` instead\.$",
        r"torch\.distributed\.c10d_logger$",
    ),
)


def apply() -> bool:
    """Install the filters of ``KNOWN`` (unless ``-W``/``PYTHONWARNINGS`` gave warning options);
    returns whether they were installed."""
    if sys.warnoptions:
        return False
    for category, message, module in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    return True
