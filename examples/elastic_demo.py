"""Local elastic demo: a real torchrun job that loses a worker and gains a node.

    python examples/elastic_demo.py [--workdir DIR] [--steps N]

What happens (1 to 2 minutes on 2 CPU cores):

1. two torchrun agents (``--nnodes=2:4 --nproc_per_node=1 --max_restarts=3``) start
   the tiny GPT on one rendezvous (``--rdzv_backend=ft``, this project's backend for
   stock torchrun; ``--rdzv-backend c10d``: torchrun's own; the store runs in its own process),
   through the warm-start launcher (``-m warmstart -m trainer``: restarts are forked
   from a per-node interpreter that already imported torch; ``--plain``: ``-m trainer``);
2. a worker is SIGKILLed (fault ``kill:step=24:rank=1`` for 120 steps): torchrun restarts the
   group, which resumes from the last committed checkpoint;
3. a third agent joins: the job re-rendezvouses at world size 3, reshards the
   checkpoint and continues at the same global sample position;
4. at the end it prints a summary (steps, restarts, world sizes over time,
   checkpoints, time lost to failures, final loss) and writes a goodput timeline
   picture, ``RUN_DIR/timeline.png`` (same as ``python -m trainer report RUN_DIR``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

# Run as ``python examples/elastic_demo.py``: sys.path[0] is examples/, so the repo root
# (where the ``testing`` harness lives; it is not installed) goes in front.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from testing.local_cluster import REPO, ElasticJob


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workdir",
        default=os.path.join(REPO, "runs", time.strftime("demo-%Y%m%d-%H%M%S")),
        help="where checkpoints, metrics and agent logs go (default: runs/demo-<time>)",
    )
    parser.add_argument(
        "--steps", type=int, default=120, help="optimizer steps to train (default 120)"
    )
    parser.add_argument(
        "--timeout", type=float, default=600, help="give up after this many seconds"
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="start workers as `-m trainer` (every restart imports torch again) "
        "instead of `-m warmstart -m trainer`",
    )
    parser.add_argument(
        "--rdzv-backend",
        choices=("ft", "c10d"),
        default="ft",
        help="torchrun's --rdzv_backend: ft (this project's, sub-second rounds; default) "
        "or c10d (torchrun's own, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set for it)",
    )
    args = parser.parse_args()

    kill_at, join_after = max(3, args.steps // 5), max(5, args.steps // 5 + 10)
    job = ElasticJob(
        workdir=args.workdir,
        module="trainer" if args.plain else "warmstart",
        trainer_args=([] if args.plain else ["-m", "trainer"])
        + [
            "--config",
            "examples/tiny_gpt.toml",
            "--max-steps",
            str(args.steps),
            "--ckpt-every",
            "10",
            "--set",
            "run.log_every=5",
            "--set",
            "run.watchdog_s=60",
        ],
        env={"TRAINER_FAULTS": f"kill:step={kill_at}:rank=1"},
        rdzv_id=os.path.basename(args.workdir.rstrip("/")),
        rdzv_backend=args.rdzv_backend,
    )
    deadline = time.monotonic() + args.timeout
    with job:
        print(f"demo: work dir {args.workdir}, rendezvous backend {args.rdzv_backend}")
        print(
            f"demo: starting 2 agents; rank 1 will be SIGKILLed at step {kill_at}, "
            f"a third agent joins after step {join_after}"
        )
        job.add_agent()
        job.add_agent()
        joined = False
        last_report = 0.0
        while time.monotonic() < deadline and any(a.proc.poll() is None for a in job.agents):
            rows = job.metrics()
            if rows and time.monotonic() - last_report > 5:
                last_report = time.monotonic()
                r = rows[-1]
                print(
                    f"demo: step {r['step']:>4}/{args.steps}  loss {r['loss']:.3f}  "
                    f"world {r['world_size']}  restarts {r['restart_count']}"
                )
            if (
                not joined
                and rows
                and rows[-1]["restart_count"] >= 1
                and rows[-1]["step"] >= join_after
            ):
                print("demo: adding a third agent (a node joins)")
                job.add_agent()
                joined = True
            time.sleep(0.5)
        codes = job.wait_agents(max(1.0, deadline - time.monotonic()))
        if any(codes.values()):
            print(f"demo: agents exited with {codes}; logs in {args.workdir}\n{job.logs_tail()}")
            return 1
        print(f"demo: all agents finished: {codes}")
    report = subprocess.run([sys.executable, "-m", "trainer", "report", job.run_dir], cwd=REPO)
    return report.returncode


if __name__ == "__main__":
    sys.exit(main())
