#!/usr/bin/env bash
# Elastic multi-node launch with plain torchrun: 2 to 4 nodes, N processes per node.
#
# Run this script on every node of the job (same arguments, same environment), e.g.
# from ssh, pdsh, a cloud instance template or your own scheduler:
#
#     RDZV_HOST=10.0.0.2 JOB=gpt-2026-11-21a NPROC=8 \
#     CKPT_DIR=gs://my-bucket/runs/gpt RUN_DIR=/shared/runs/gpt \
#         bash examples/recipes/multinode.sh node
#
# Nodes may start in any order and at different times: the first 2 form the job,
# later ones (up to 4) join it at the next rendezvous round (the running group is
# restarted from the newest committed checkpoint with the larger world size). A node
# that dies is dropped once its rendezvous keep-alives stop (1.5 s with the default
# backend, ft) and the others continue from the last checkpoint. Details, measured
# recovery times and the reasons for each setting: docs/launching.md. Run as written on 3
# hosts (network namespaces with their own address and hostname, RDZV_HOST = the first
# host's name) by tests/e2e/test_slurm_e2e.py::test_multinode_sh_trains_on_three_namespace_hosts.
#
# Rendezvous backend (RDZV_BACKEND): ft by default, this project's handler for stock
# torchrun (elastic/rendezvous.py; registered when the project is pip-installed):
# sub-second rounds, a re-round done as soon as every live node is back, and workers
# that never share the agent's store, so no environment variable is needed.
# RDZV_BACKEND=c10d uses torchrun's own, with the settings below.
#
# Two ways to host the rendezvous store (the TCP store the agents use to agree on
# membership):
#
#   1. default: the torchrun agent on RDZV_HOST hosts it (torchrun decides this by
#      matching RDZV_HOST against the machine's own hostname/addresses). Simple, but
#      the agent on that node is a single point of failure: if it dies, the store
#      dies with it and the whole job ends, even though the other nodes are healthy.
#
#   2. standalone store (STANDALONE_STORE=1): run `bash multinode.sh store` once on
#      a small, long-lived machine (it can be one of the training nodes, but then it
#      must outlive that node's trainer), and pass is_host=0 to every agent so that
#      no agent tries to host it. Then losing any agent or node, the first one
#      included, only shrinks the job. This is how testing/local_cluster.py (the e2e
#      tests and examples/elastic_demo.py) runs its multi-agent jobs.
#
# Settings (all measured on this project with torch 2.13, see docs/launching.md):
#   with RDZV_BACKEND=c10d only:
#   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   required: otherwise workers of a restarted
#       group reuse the rank-0 agent's TCP store and can read stale peer addresses
#       (gloo "Connection refused" in 3 of 5 worker-kill runs; a scale-up hung;
#       pytorch#135712).
#   last_call_timeout=1          a worker kill cost 34 s of recovery with the default
#       30 s, 4.7 s with 1 s.
#   keep_alive_interval=1, keep_alive_max_attempt=5   a lost node is dropped after
#       about 5 s of missed heartbeats instead of 5 x 3 = 15 s. Not 1 x 2: heartbeats
#       land about 2 s apart with interval 1, so with 1 x 2 a joining node can judge
#       live nodes dead and start a new round alone; scale-up then never happens
#       (seen here with torch 2.13; 1 x 5 joined within 2 s).
#   with either backend:
#   --shutdown-timeout / TRAINER_PREEMPTION_GRACE_S   the SIGTERM -> SIGKILL grace
#       when the agent itself is signalled (preemption, drain). The workers cannot
#       see the torchrun flag, so the trainer reads TRAINER_PREEMPTION_GRACE_S, then
#       PET_SHUTDOWN_TIMEOUT, then TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s if none):
#       keep them equal. On a worker-group restart torchrun always waits 30 s.
#
# Use a fresh JOB (rdzv_id) for every launch of the script, but keep CKPT_DIR: the
# run id of a checkpoint is the rdzv_id, and checkpoints fence writers by
# (run id, restart count); a relaunch under an old id starts again at restart
# count 0 and can be refused as "an older attempt" by that id's newest commit.

set -euo pipefail

usage() {
    echo "usage: RDZV_HOST=... JOB=... CKPT_DIR=... RUN_DIR=... $0 node|store" >&2
    exit 2
}

MODE="${1:-}"
[[ "$MODE" == node || "$MODE" == store ]] || usage
shift  # anything after the mode is passed on to the trainer, e.g. --max-steps 1000

RDZV_HOST="${RDZV_HOST:?set RDZV_HOST to the rendezvous host (first node or the store machine)}"
RDZV_PORT="${RDZV_PORT:-29500}"
RDZV_BACKEND="${RDZV_BACKEND:-ft}"

if [[ "$MODE" == store ]]; then
    # Standalone rendezvous store: one process, nothing but a TCPStore server.
    # wait_for_workers=False: it must not wait for a fixed number of clients.
    # Stop it (Ctrl-C or kill <pid>) after the job has finished.
    exec python -c '
import sys, time
from torch.distributed import TCPStore
store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False)
print(f"rendezvous store listening on {sys.argv[1]}:{sys.argv[2]}", flush=True)
while True:
    time.sleep(3600)
' "0.0.0.0" "$RDZV_PORT"
fi

JOB="${JOB:?set JOB to a new rendezvous id for this launch, the same on every node}"
CKPT_DIR="${CKPT_DIR:?set CKPT_DIR, e.g. gs://my-bucket/runs/gpt (local path works too)}"
# Global rank 0 writes metrics.jsonl/events.jsonl, and after a restart rank 0 can be
# on any node: put RUN_DIR on a filesystem all nodes share to keep one record.
RUN_DIR="${RUN_DIR:?set RUN_DIR (metrics.jsonl/events.jsonl, written by global rank 0)}"
NPROC="${NPROC:-1}"                       # processes per node (usually GPUs per node)
CONFIG="${CONFIG:-examples/tiny_gpt.toml}"
GRACE_S="${GRACE_S:-60}"                  # SIGTERM -> SIGKILL budget on preemption (whole seconds)

if [[ "$RDZV_BACKEND" == c10d ]]; then
    RDZV_CONF="last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"
    # Every agent, every launch: do not share the rendezvous TCP store with the workers.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
elif [[ "$RDZV_BACKEND" == ft ]]; then
    RDZV_CONF="join_timeout=600"  # its other settings are sub-second by default
else
    echo "RDZV_BACKEND must be ft or c10d, not '${RDZV_BACKEND}'" >&2
    exit 2
fi
if [[ "${STANDALONE_STORE:-0}" == 1 ]]; then
    # No agent hosts the store; all of them connect to `multinode.sh store`.
    RDZV_CONF="is_host=0,${RDZV_CONF}"
fi

# The trainer's emergency-save budget: the same number as --shutdown-timeout below.
export TRAINER_PREEMPTION_GRACE_S="$GRACE_S"
# Storage: a bounded time per call and bounded retries (defaults shown).
export CKPT_STORAGE_TIMEOUT_S="${CKPT_STORAGE_TIMEOUT_S:-300}"
export CKPT_STORAGE_RETRIES="${CKPT_STORAGE_RETRIES:-6}"
export CKPT_STORAGE_RETRY_TOTAL_S="${CKPT_STORAGE_RETRY_TOTAL_S:-120}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# Optional: LOCAL_ADDR=<this node's address on the training network> when the
# hostname resolves to the wrong interface (multi-homed machines).
LOCAL_ADDR_ARGS=()
if [[ -n "${LOCAL_ADDR:-}" ]]; then
    LOCAL_ADDR_ARGS=(--local_addr="$LOCAL_ADDR")
fi

# run.watchdog_s: a rank that makes no progress for this long (a frozen peer, a
# collective stuck because another node's agent was killed but its worker kept
# running: pytorch#111646) dumps its stacks and exits, and torchrun restarts the
# group from the last committed checkpoint. Keep it above the slowest normal step.
exec torchrun \
    --nnodes=2:4 \
    --nproc_per_node="$NPROC" \
    --max_restarts=3 \
    --rdzv_backend="$RDZV_BACKEND" \
    --rdzv_endpoint="${RDZV_HOST}:${RDZV_PORT}" \
    --rdzv_id="$JOB" \
    --rdzv_conf="$RDZV_CONF" \
    --shutdown-timeout="$GRACE_S" \
    "${LOCAL_ADDR_ARGS[@]}" \
    -m warmstart -m trainer \
    --config "$CONFIG" \
    --ckpt-dir "$CKPT_DIR" \
    --run-dir "$RUN_DIR" \
    --set run.watchdog_s=300 \
    "$@"
