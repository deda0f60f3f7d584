"""Command line of ``python -m trainer`` (the contract in docs/design.md).

Precedence: defaults < TOML file < ``--set`` overrides < dedicated flags
(``--ckpt-dir``, ``--resume``, ``--max-steps``, ``--ckpt-every``, ``--run-dir``, ``--fault``).
"""

from __future__ import annotations

import argparse

from ckpt import env as ckpt_env
from ckpt.storage import faults as ckpt_faults
from trainer.config import TrainConfig, load_config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer",
        description="Fault-tolerant elastic GPT trainer (FSDP2). Launch with torchrun for "
        "several ranks, or plainly for one. Resumes from the newest committed checkpoint.",
        epilog="Subcommand: python -m trainer report RUN_DIR [--out PNG] [--json] summarizes a run "
        "directory (steps, restarts, world sizes, checkpoints, time lost, goodput) and draws a "
        "timeline PNG (needs matplotlib); see python -m trainer report --help.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        help="TOML config with [model], [data], [optim], [checkpoint], [run] tables (default: built-in defaults)",
    )
    parser.add_argument(
        "--ckpt-dir",
        metavar="URL",
        help="checkpoint root (path, file://, memory://, gs://); overrides checkpoint.dir; resume happens from here",
    )
    parser.add_argument(
        "--resume",
        choices=("true", "false", "must"),
        help="true (default): resume from the newest committed checkpoint under the root if there "
        "is one, else start from step 0 and say so; false: start from step 0 (a torchrun restart "
        "of the same job still resumes the checkpoints this job wrote); must: exit 1 when "
        "the root holds no committed checkpoint (overrides checkpoint.resume). A root that is, or "
        "is inside, a checkpoint directory is refused, and so is one the job cannot write (exit 1)",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        metavar="N",
        help="total optimizer steps to reach (overrides run.max_steps)",
    )
    parser.add_argument(
        "--ckpt-every",
        type=int,
        metavar="N",
        help="save a checkpoint every N steps (overrides checkpoint.every; 0 = only at the end)",
    )
    parser.add_argument(
        "--run-dir",
        metavar="DIR",
        help="where rank 0 writes metrics.jsonl and events.jsonl, and other ranks the events they "
        "record themselves (a fault fired there) to events.rank{R}.jsonl (overrides run.run_dir)",
    )
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="inject a fault, repeatable: KIND:step=S[:rank=R][:attempt=A], KIND in kill, exit, raise, hang, "
        "sigterm, ckpt-storage, nan; fires at the start of step S (steps 1..S-1 done) in the attempt "
        "whose job-wide restart count is A (default 0). ckpt-storage also takes phase=P, error=E, "
        "times=N (default: the next save's first shard write fails with a permanent error); nan "
        "makes that rank's parameters NaN (a divergence: run.divergence decides). at=POINT "
        "instead of step=S fires in the start-up, POINT in init_process_group, "
        "checkpoint_manager, resume. Also read from env TRAINER_FAULTS (';'-separated)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="SECTION.KEY=VALUE",
        help="override one config value, repeatable, e.g. --set optim.lr=3e-4 --set model.n_layer=4",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Merge the TOML file, ``--set`` overrides and the dedicated flags into a validated config."""
    overrides = list(args.overrides)
    if args.ckpt_dir is not None:
        overrides.append(f"checkpoint.dir={args.ckpt_dir}")
    if args.resume is not None:
        overrides.append(f"checkpoint.resume={args.resume}")
    if args.max_steps is not None:
        overrides.append(f"run.max_steps={args.max_steps}")
    if args.ckpt_every is not None:
        overrides.append(f"checkpoint.every={args.ckpt_every}")
    if args.run_dir is not None:
        overrides.append(f"run.run_dir={args.run_dir}")
    cfg = load_config(args.config, overrides)
    cfg.run.faults = [*cfg.run.faults, *args.fault]
    ckpt_env.validate()  # a bad CKPT_* variable is a bad configuration: exit 2, before training
    ckpt_faults.check_env()
    return cfg
