"""The event schema: every event a run writes, its name, its fields and who writes it.

Writers (``ckpt``, ``elastic``, ``trainer``, user scripts through
``elastic.RunRecorder``) emit events by these names; readers (``trainer/report.py``,
``bench``) select them by the same names. An event line in ``events.jsonl`` is
``{"event": NAME, "step": S, "time": T, "rank": R, **fields}``; :data:`SCHEMA` lists the
fields each known event always carries (more may follow; :func:`missing_fields` checks a
record). Names outside the schema are allowed (a user's own events).

The checkpoint library reports to ``on_event`` callbacks of ``ckpt.save``/``ckpt.load``
with its own low-level names (``ckpt_saved``, ...); a ``CheckpointManager`` renames them
for the run log by :data:`RUN_LOG_NAME`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EventType:
    """One kind of event: its name, the fields it always carries, its writer."""

    name: str
    fields: tuple[str, ...]
    writer: str
    doc: str


# -- the checkpoint library's own callbacks (ckpt.save / ckpt.load on_event) ---------------
CKPT_SAVED = "ckpt_saved"
CKPT_LOADED = "ckpt_loaded"
CKPT_FALLBACK = "ckpt_fallback"
CKPT_QUARANTINED = "ckpt_quarantined"

# -- the run log: CheckpointManager -------------------------------------------------------
CHECKPOINT_SAVED = "checkpoint_saved"
CHECKPOINT_LOADED = "checkpoint_loaded"
CHECKPOINT_FAILED = "checkpoint_failed"
FALLBACK = "fallback"
QUARANTINE = "quarantine"
RESUME = "resume"
TIER_CHOICE = "tier_choice"
MEMORY_SNAPSHOT_FAILED = "memory_snapshot_failed"
BATCH_CHANGE = "batch_change"

# -- the run log: RunGuard -----------------------------------------------------------------
FAULT = "fault"
PEER_SILENT = "peer_silent"
PEER_STALLED = "peer_stalled"
WATCHDOG_STALL = "watchdog_stall"
PREEMPTED = "preempted"
STRAGGLERS = "stragglers"
DETERMINISTIC_ERROR = "deterministic_error"
DIVERGED = "diverged"
ROLLED_BACK = "rolled_back"

# -- the run log: the training loop (built-in trainer, examples) -------------------------
START = "start"
FINAL_PARAMS = "final_params"
FINISHED = "finished"

_SAVED_FIELDS = ("url", "bytes", "duration_s", "blocking_s", "async", "world_size")
_LOADED_FIELDS = ("url", "bytes", "duration_s", "saved_world_size", "world_size")
_FALLBACK_FIELDS = ("url", "path", "reason")
_QUARANTINE_FIELDS = ("url", "kept_at", "path", "reason")

_TYPES = (
    EventType(CKPT_SAVED, _SAVED_FIELDS, "ckpt.saving.commit", "a checkpoint committed"),
    EventType(CKPT_LOADED, _LOADED_FIELDS, "ckpt.loading.restore", "a checkpoint loaded"),
    EventType(CKPT_FALLBACK, _FALLBACK_FIELDS, "ckpt.loading.restore", "a checkpoint skipped on load"),
    EventType(CKPT_QUARANTINED, _QUARANTINE_FIELDS, "ckpt.loading.restore", "a checkpoint set aside"),
    EventType(CHECKPOINT_SAVED, _SAVED_FIELDS, "ckpt.manager", "ckpt_saved in the run log"),
    EventType(CHECKPOINT_LOADED, _LOADED_FIELDS, "ckpt.manager", "ckpt_loaded in the run log"),
    EventType(FALLBACK, _FALLBACK_FIELDS, "ckpt.manager", "ckpt_fallback in the run log"),
    EventType(QUARANTINE, _QUARANTINE_FIELDS, "ckpt.manager", "ckpt_quarantined in the run log"),
    EventType(
        CHECKPOINT_FAILED,
        ("error", "rank", "consecutive"),
        "ckpt.manager",
        "a save failed (emergency: true for an emergency save)",
    ),
    EventType(
        RESUME,
        ("url", "old_world_size", "new_world_size", "rng_restored", "bytes", "duration_s"),
        "ckpt.manager",
        "a resume finished (tier with the memory tier on)",
    ),
    EventType(
        TIER_CHOICE,
        ("tier", "reason", "durable_step"),
        "ckpt.manager",
        "which tier a resume used and why (memory tier on)",
    ),
    EventType(
        MEMORY_SNAPSHOT_FAILED,
        ("phase", "error", "rank"),
        "ckpt.manager",
        "a memory-tier snapshot or its replication failed (training goes on)",
    ),
    EventType(
        BATCH_CHANGE,
        ("key", "cursor", "old_global_batch", "new_global_batch"),
        "ckpt.manager",
        "a resume continued a sampler's cursor with another global batch (opt-in)",
    ),
    EventType(FAULT, ("spec", "rank"), "elastic.guard", "a fault injected on purpose"),
    EventType(
        PEER_SILENT,
        ("rank", "silent_ranks", "hosts", "silent_s", "bound_s", "store_silent", "store"),
        "elastic.guard",
        "the heartbeat found peers silent past the bound; the rank exits",
    ),
    EventType(
        PEER_STALLED,
        ("rank", "stalled_rank", "stalled_s", "host", "node", "limit_s"),
        "elastic.guard",
        "a peer sent no heartbeat past the bound while its node lived: waited for, not removed",
    ),
    EventType(
        WATCHDOG_STALL,
        ("stalled_s", "dump_path", "rank"),
        "elastic.guard",
        "the hang watchdog found no progress",
    ),
    EventType(
        PREEMPTED,
        ("reason", "emergency_save"),
        "elastic.guard",
        "a termination signal stopped training",
    ),
    EventType(
        DIVERGED,
        ("loss", "policy", "action", "last_checkpoint_step", "rollbacks"),
        "elastic.guard",
        "the loss was not finite (NaN or inf) on some rank; action: stop or rollback",
    ),
    EventType(
        ROLLED_BACK,
        ("from_step", "to_step", "skipped_batches", "skipped_positions", "rollbacks"),
        "elastic.guard",
        "restored the last finite checkpoint and skipped global batches after it",
    ),
    EventType(
        STRAGGLERS,
        ("window_steps", "ranks", "step_times_s", "median_s", "factor", "stragglers"),
        "elastic.guard",
        "ranks slower than factor x the median step time",
    ),
    EventType(
        DETERMINISTIC_ERROR,
        ("error", "point", "message", "repeated", "restart_count"),
        "elastic.guard",
        "an error a restart reproduces ended the attempt (repeated: the same one, at the "
        "same point, as the previous attempt: the job's later attempts end at start-up)",
    ),
    EventType(START, ("world_size", "restart_count"), "trainer.loop", "an attempt started"),
    EventType(FINAL_PARAMS, ("path",), "trainer.loop", "the final parameters were written"),
    EventType(FINISHED, (), "trainer.loop", "training reached its last step"),
)

SCHEMA: Mapping[str, EventType] = {t.name: t for t in _TYPES}
"""Every known event by name."""

RUN_LOG_NAME: Mapping[str, str] = {
    CKPT_SAVED: CHECKPOINT_SAVED,
    CKPT_LOADED: CHECKPOINT_LOADED,
    CKPT_FALLBACK: FALLBACK,
    CKPT_QUARANTINED: QUARANTINE,
}
"""How the checkpoint library's own events are named in the run log."""


def missing_fields(record: Mapping[str, object]) -> list[str]:
    """The fields a record of a known event lacks ([] for a complete or unknown one)."""
    kind = SCHEMA.get(str(record.get("event", "")))
    if kind is None:
        return []
    return [name for name in ("step", *kind.fields) if name not in record]
