"""Entry point: ``python -m trainer --config FILE.toml ...`` (see ``--help``).

``python -m trainer report RUN_DIR ...`` summarizes a finished run instead (trainer/report.py).

Exit codes: 0 done; 1 a configuration/environment error found after start (batch layout,
checkpoint directory ``ckpt.CheckpointDirError``: unreachable, not writable, a checkpoint
itself; checkpoint of another model ``ckpt.CheckpointShapeError``; no checkpoint with
``--resume must``; ``checkpoint.max_failures`` saves failed in a row or the final save
failed ``ckpt.TooManySaveFailuresError``; any other checkpoint library error, another job
holding the root's lease ``ckpt.RootLeaseError`` included); 2 a bad command line or config
(argparse style); 3 the loss was not finite and ``run.divergence`` stopped the run
(``elastic.Diverged``); 128+N stopped by signal N (SIGTERM: 143).
"""

from __future__ import annotations

import gc
import logging
import sys

from elastic.identity import RunIdentity
from elastic.process import exit_now
from elastic.repeats import stop_if_repeated

logger = logging.getLogger("trainer")


def _setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    """Parse, check, build, train, close. Every rank runs it."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        from trainer.report import main as report_main

        return report_main(argv[1:])
    try:
        identity = RunIdentity.from_env()
    except ValueError:
        identity = None  # said by the parser below
    if identity is not None:
        # Before torch is imported: an attempt that an earlier one's repeated error ends
        # (elastic/repeats.py) leaves in a tenth of a second instead of paying the imports.
        stop_if_repeated(identity)
    return _run(argv)


def _run(argv: list[str]) -> int:
    import ckpt
    from elastic.errors import Diverged, Preempted
    from elastic.repeats import note_job_ending
    from trainer.cli import build_parser, config_from_args
    from trainer.data import BatchLayout, BatchLayoutError
    from trainer.distributed import close_distributed, init_distributed
    from trainer.loop import ResumePastEndError, train

    # Errors caused by the configuration or the environment: reported without a traceback.
    user_errors = (BatchLayoutError, ckpt.CheckpointError, ResumePastEndError)
    # torch and the rest are imported: their objects live as long as the process, so the
    # cyclic collector stops walking them (a full collection otherwise takes a fraction
    # of a second and lands in a step or the resume at random). See docs/design.md,
    # "Warm restarts".
    gc.freeze()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        identity = RunIdentity.from_env()
    except ValueError as exc:
        parser.error(str(exc))
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        # The same arguments fail the same way in every restart: the job ends here.
        note_job_ending(identity, "ConfigError", str(exc))
        parser.error(str(exc))
    _setup_logging(identity.rank)
    try:
        # Fail before the rendezvous: every rank knows the world size from the environment.
        BatchLayout.plan(cfg.data.global_batch, cfg.data.micro_batch, identity.world_size)
    except BatchLayoutError as exc:
        logger.error("rank %d: %s", identity.rank, exc)
        return 1
    ctx = init_distributed(
        identity,
        timeout_s=cfg.run.collective_timeout_s,
        peer_timeout_s=cfg.run.peer_timeout_s,
        heartbeat_s=cfg.run.heartbeat_s,
    )
    try:
        train(cfg, ctx)
    except user_errors as exc:
        logger.error("rank %d: %s: %s", ctx.rank, type(exc).__name__, exc)
        return 1
    except Preempted as exc:
        logger.warning("rank %d: %s", ctx.rank, exc)
        return exc.exit_code
    except Diverged as exc:  # said at ERROR by rank 0 with the step and how to resume
        return exc.exit_code
    finally:
        close_distributed()
    return 0


if __name__ == "__main__":
    exit_now(main())
