"""``megarl`` command line: one subcommand per subsystem, each living in its own package.

Subcommands are imported only when run, so ``megarl --help`` stays fast and a subsystem's heavy
imports (megatron, transformers) load only for the command that needs them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

# name -> ("module:function", one-line help). A subcommand whose module is absent is not listed.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megarl.trainer.train_cli:main", "run an RL job from a YAML config"),
    "convert": (
        "megarl.convert.convert_cli:main",
        "convert checkpoints: Hugging Face <-> Megatron",
    ),
    "launch": ("megarl.launch.__main__:main", "per-node Slurm launcher (run by srun inside an sbatch job)"),
    "proxy": ("megarl.proxy.proxy_cli:main", "build proxy MoE models, replay and compare faults"),
}


def _available() -> dict[str, tuple[str, str]]:
    out = {}
    for name, (target, help_) in SUBCOMMANDS.items():
        mod = target.split(":")[0]
        try:
            found = importlib.util.find_spec(mod) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            out[name] = (target, help_)
    return out


def _usage(avail: dict) -> str:
    lines = ["usage: megarl <command> [args...]", "", "commands:"]
    lines += [f"  {n:<9} {h}" for n, (_, h) in avail.items()]
    lines += ["", "`megarl <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``megarl <command> ...`` to the command's own ``main(argv)``."""
    from megarl import quiet_warnings

    quiet_warnings.apply()
    argv = list(sys.argv[1:] if argv is None else argv)
    avail = _available()
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(avail))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in avail:
        print(f"megarl: unknown command {name!r}; available: {', '.join(avail) or 'none'}", file=sys.stderr)
        return 2
    mod, fn = avail[name][0].split(":")
    return int(getattr(importlib.import_module(mod), fn)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
