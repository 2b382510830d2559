"""``megarl train CONFIG.yaml [section.key=value ...]``."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, load and check the config, run the trainer; returns the exit code."""
    ap = argparse.ArgumentParser(
        prog="megarl train",
        description="Run an RL job from a YAML config. Overrides: section.key=value (YAML values), e.g. "
        "schedule.steps=20 logging.run_dir=runs/try2. Continues the run in logging.run_dir from its "
        "newest complete checkpoint; checkpoint.resume=never starts a new run (a run_dir that holds "
        "one: checkpoint.on_existing=archive|overwrite).",
    )
    ap.add_argument("config", help="YAML config (see examples/quickstart.yaml, docs/trainer.md)")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    ap.add_argument("--check", action="store_true", help="validate the config and exit")
    args = ap.parse_args(argv)

    from megarl.trainer.config import ConfigError, load_config
    from megarl.trainer.config_checks import check_layout, layout_hf_config

    try:
        cfg = load_config(args.config, args.overrides)
        if args.check:  # the run checks the layout at setup, when the world size is known
            world = os.environ.get("WORLD_SIZE")
            check_layout(cfg, layout_hf_config(cfg), int(world) if world else cfg.parallel.world_size or None)
    except ConfigError as e:
        print(f"megarl train: config error: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(f"megarl train: {args.config}: config OK")
        return 0
    from megarl.trainer.threads import ThreadsError, set_torch_threads

    try:
        set_torch_threads()  # MEGARL_NUM_THREADS, else cores / local ranks
    except ThreadsError as e:
        print(f"megarl train: {e}", file=sys.stderr)
        return 2
    from megarl.data.dataset import DataError
    from megarl.learner.dist_checkpoint import CheckpointError
    from megarl.trainer.checkpoint_check import ForeignCheckpointError
    from megarl.trainer.loop import trainer_class
    from megarl.trainer.run_checkpoint import CheckpointSaveError

    try:
        return trainer_class(cfg)(cfg).run()
    except (ConfigError, DataError) as e:
        kind = "config" if isinstance(e, ConfigError) else "data"
        print(f"megarl train: {kind} error: {e}", file=sys.stderr)
        return 2
    except (CheckpointSaveError, ForeignCheckpointError, CheckpointError) as e:
        print(f"megarl train: checkpoint error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
