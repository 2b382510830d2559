"""The catalogue of built-in methods and parts: names -> ``"module:attr"``, imported on demand.

Registration runs one way: method families import the registries (megarl/registry.py, the
objective and advantage registries, megarl/plugin/inputs.py) and register their parts when
imported; nothing below them imports a family. The composition root (the trainer's run builder,
the config check) calls ``load_builtin()`` to import the built-in families, and
``method_spec(section)`` to resolve the config's ``method`` section, in-tree by name or from the
user's own package by ``import: "pkg.module:SPEC"``.
"""

from __future__ import annotations

import importlib
from typing import Any

# modules whose import registers the built-in parts (objective parts, input providers, workflows)
BUILTIN_MODULES: tuple[str, ...] = (
    "megarl.methods.trust_regions",
    "megarl.methods.credit",
    "megarl.methods.peers",
    "megarl.methods.critics",
    "megarl.methods.distillation",
    "megarl.methods.allocation",
    "megarl.methods.gradients",
    "megarl.methods.agents",
    "megarl.rewards.shaping",
    "megarl.plugin.core_inputs",
    "megarl.rollout.workflow",
    "megarl.rollout.tool_env",
    "megarl.rollout.grid_env",
    "megarl.rollout.instructed",
    "megarl.rollout.review",
    "megarl.rollout.reflect",
    "megarl.rollout.instructed",
)

# torch-free modules whose import contributes config sections and keys (megarl/plugin/config_parts.py):
# imported before a config is built, so their keys load and range-check before anything heavy
CONFIG_MODULES: tuple[str, ...] = (
    "megarl.plugin.teacher_config",
    "megarl.rollout.review",
    "megarl.rollout.reflect",
    "megarl.rollout.instructed",
)

# method name -> "module:attr" of its MethodSpec
METHODS: dict[str, str] = {
    "gapo": "megarl.methods.trust_regions.gapo:SPEC",
    "sao": "megarl.methods.trust_regions.sao:SPEC",
    "estr": "megarl.methods.trust_regions.estr:SPEC",
    "eppo": "megarl.methods.trust_regions.eppo:SPEC",
    "cokl": "megarl.methods.trust_regions.cokl:SPEC",
    "output_reset": "megarl.methods.trust_regions.output_reset:SPEC",
    "gepo": "megarl.methods.credit.gepo:SPEC",
    "taco": "megarl.methods.credit.taco:SPEC",
    "dash": "megarl.methods.credit.dash:SPEC",
    "gigpo": "megarl.methods.credit.gigpo:SPEC",
    "pgpo": "megarl.methods.credit.pgpo:SPEC",
    "softmax_grpo": "megarl.methods.credit.softmax_grpo:SPEC",
    "rspo": "megarl.methods.credit.rspo:SPEC",
    "rrpo": "megarl.methods.credit.rrpo:SPEC",
    "gpg": "megarl.methods.peers.gpg:SPEC",
    "gmpo": "megarl.methods.peers.gmpo:SPEC",
    "clip_cov": "megarl.methods.peers.cov:CLIP_COV",
    "kl_cov": "megarl.methods.peers.cov:KL_COV",
    "bypass": "megarl.methods.peers.bypass:SPEC",
    "dro": "megarl.methods.peers.bypass:DRO",
    "opo": "megarl.methods.peers.outcome:OPO",
    "grpo_passk": "megarl.methods.peers.outcome:GRPO_PASSK",
    "remax": "megarl.methods.peers.remax:SPEC",
    "kl_reward": "megarl.methods.peers.kl_reward:SPEC",
    "otb": "megarl.methods.peers.otb:SPEC",
    "ppo_critic": "megarl.methods.critics.ppo_critic:SPEC",
    "bpco": "megarl.methods.critics.bpco:SPEC",
    "comppo": "megarl.methods.critics.comp_gae:SPEC",
    "sapo": "megarl.methods.critics.sapo:SPEC",
    "amrp": "megarl.rewards.shaping.amrp:SPEC",
    "care": "megarl.rewards.shaping.care:SPEC",
    "cedar": "megarl.rewards.shaping.cedar:SPEC",
    "reward_floor": "megarl.rewards.shaping.reward_floor:SPEC",
    "rubric_dropout": "megarl.rewards.shaping.rubric_dropout:SPEC",
    "isdpo": "megarl.methods.distillation.isdpo:SPEC",
    "sc_grpo": "megarl.methods.distillation.sc_grpo:SPEC",
    "uopsd": "megarl.methods.distillation.uopsd:SPEC",
    "sara": "megarl.methods.allocation.sara:SPEC",
    "pac": "megarl.methods.allocation.pac:SPEC",
    "mass": "megarl.methods.allocation.mass:SPEC",
    "pair": "megarl.methods.allocation.pair:SPEC",
    "trajval": "megarl.methods.allocation.trajval:SPEC",
    "specroll": "megarl.methods.allocation.specroll:SPEC",
    "llmzero": "megarl.methods.allocation.llmzero:SPEC",
    "es": "megarl.methods.gradients.es:SPEC",
    "3po": "megarl.methods.gradients.three_po:SPEC",
    "gupo": "megarl.methods.gradients.gupo:SPEC",
    "gcpo": "megarl.methods.gradients.gcpo:SPEC",
    "agon": "megarl.methods.gradients.agon:SPEC",
    "lc-grpo": "megarl.methods.gradients.lc_grpo:SPEC",
    "flowcts": "megarl.methods.gradients.flowcts:SPEC",
    "distilled_rl": "megarl.methods.distillation.distilled_rl:SPEC",
    "opd_regulation": "megarl.methods.distillation.opd_regulation:SPEC",
    "ra_opd": "megarl.methods.distillation.ra_opd:SPEC",
    "rstg": "megarl.methods.distillation.rstg:SPEC",
    "self_routing": "megarl.methods.distillation.self_routing:SPEC",
    "skald": "megarl.methods.distillation.skald:SPEC",
    "tide": "megarl.methods.distillation.tide:SPEC",
    "geosd": "megarl.methods.distillation.geosd:SPEC",
    "opdvr": "megarl.methods.distillation.opdvr:OPDVR",
    "grpd": "megarl.methods.distillation.opdvr:GRPD",
    "regen": "megarl.methods.agents.regen:SPEC",
    "srrl": "megarl.methods.agents.srrl:SPEC",
    "srpo": "megarl.methods.agents.srpo:SPEC",
    "crpo": "megarl.methods.agents.crpo:SPEC",
    "reflectrl": "megarl.methods.agents.reflectrl:SPEC",
    "el": "megarl.methods.agents.el:SPEC",
    "ice": "megarl.methods.agents.ice:SPEC",
    "taspo": "megarl.methods.agents.taspo:SPEC",
    "trial": "megarl.methods.agents.trial:SPEC",
    "agent_opsd": "megarl.methods.agents.agent_opsd:SPEC",
}

_loaded = False
_registered: set[int] = set()


def load_builtin() -> None:
    """Import the built-in families once (their parts register themselves)."""
    global _loaded
    if _loaded:
        return
    for mod in BUILTIN_MODULES:
        importlib.import_module(mod)
    _loaded = True


def load_config_parts() -> None:
    """Import the modules that contribute config sections and keys (``CONFIG_MODULES``)."""
    for mod in CONFIG_MODULES:
        importlib.import_module(mod)


def load_object(target: str, where: str) -> Any:
    """The object named ``"package.module:attr"``; errors name ``where`` and the target."""
    if not isinstance(target, str) or ":" not in target:
        raise ValueError(f"{where}={target!r} must look like 'package.module:attr'")
    mod, attr = target.split(":", 1)
    try:
        module = importlib.import_module(mod)
    except ImportError as e:
        raise ValueError(f"{where}={target!r}: cannot import {mod!r} ({e})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{where}={target!r}: module {mod!r} has no attribute {attr!r}") from None


def method_spec(section: dict) -> Any:
    """The ``MethodSpec`` named by a config's ``method`` section (``name`` or ``import``); its
    ``register`` hook runs once. Errors name the key and list the built-in names."""
    from megarl.plugin.spec import MethodSpec

    load_builtin()
    if "import" in section:
        spec = load_object(section["import"], "method.import")
    elif "name" in section:
        name = section["name"]
        if name not in METHODS:
            raise ValueError(
                f"method.name={name!r}; built-in methods: {', '.join(sorted(METHODS))} "
                "(or method.import: 'package.module:SPEC' for your own)"
            )
        spec = load_object(METHODS[name], f"method {name!r}")
    else:
        raise ValueError(
            "the method section needs 'name' (a built-in method) or 'import' ('package.module:SPEC')"
        )
    if not isinstance(spec, MethodSpec):
        raise ValueError(
            f"method {section.get('import', section.get('name'))!r} is a {type(spec).__name__}, "
            "not a megarl.plugin.spec.MethodSpec"
        )
    if spec.register is not None and id(spec) not in _registered:
        spec.register()
        _registered.add(id(spec))
    return spec
