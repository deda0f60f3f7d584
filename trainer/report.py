"""Run report: ``python -m trainer report RUN_DIR [--out PNG] [--json] [--no-plot]``.

Reads the ``metrics.jsonl`` and ``events.jsonl`` that global rank 0 wrote into a run
directory (possibly several torchrun attempts appended to the same files), merged
with the ``events.rank{R}.jsonl`` of the other ranks (faults, failures, watchdog and
detector verdicts they recorded), and prints what happened: steps, restarts, world
sizes over time, checkpoints, faults and failures on any rank, time lost to failures
and goodput. It also draws a goodput timeline PNG.

:func:`summarize` is pure (lists of dicts in, :class:`RunSummary` out) so it can be
tested table-driven; reading files and plotting live apart. matplotlib is imported
only inside :func:`plot_timeline`, so ``import trainer`` never needs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import itertools
import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from elastic.events import EVENTS_FILE, METRICS_FILE, RANK_EVENTS_GLOB
from runcore import events as ev

logger = logging.getLogger(__name__)

DEFAULT_PLOT_NAME = "timeline.png"
"""File name of the timeline written into the run directory when ``--out`` is not given."""

_RANK_EVENTS_RE = re.compile(r"^events\.rank(\d+)\.jsonl$")

FAULT_EVENTS = frozenset({ev.FAULT})
"""A fault injected on purpose (``--fault``), on whichever rank recorded it."""
FAILURE_EVENTS = frozenset({ev.PEER_SILENT, ev.DETERMINISTIC_ERROR, ev.DIVERGED})
"""A rank reporting a failure that ends its attempt: a silent peer, an error a restart
would repeat, a loss that is not finite."""
WATCHDOG_EVENTS = frozenset({ev.WATCHDOG_STALL})
"""The hang watchdog giving up on a rank."""
DETECTOR_EVENTS = frozenset({ev.STRAGGLERS})
"""The straggler detector's verdict."""


class RunReportError(ValueError):
    """A run directory that cannot be reported on (missing, or without any metrics)."""


@dataclass(frozen=True, slots=True)
class Attempt:
    """One contiguous stretch of metrics rows written by one torchrun attempt.

    A new attempt starts when ``restart_count`` or ``world_size`` changes, or when the
    step does not increase (a resume from an older checkpoint re-runs steps).
    Times are seconds since the start of the run (see :attr:`RunSummary.start_time`).
    """

    index: int
    restart_count: int
    world_size: int
    first_step: int
    last_step: int
    rows: int
    start_s: float
    """Offset of the first row's step start (its ``time`` minus its ``step_time_s``)."""
    end_s: float
    """Offset of the last row (the end of the last step this attempt finished)."""


@dataclass(slots=True)
class RunSummary:
    """What one run directory says happened; every time is in seconds.

    Definitions:

    * ``wall_time_s``: from the start of the first recorded step (first row's ``time``
      minus its ``step_time_s``) to the last row's ``time``.
    * ``rerun_steps``: rows whose step number appears again in a later row: work that
      a failure threw away. ``rerun_time_s`` is the sum of their ``step_time_s``.
    * ``downtime_s``: for each attempt boundary, the wall time from the last row of the
      attempt that stopped to the start of the first step of the next attempt (first
      row's ``time`` minus its ``step_time_s``): detection, restart, rendezvous, model
      build and checkpoint load. Clamped at 0.
    * ``time_lost_s = downtime_s + rerun_time_s``.
    * ``productive_time_s``: sum of ``step_time_s`` of rows that were not re-run later.
    * ``goodput = productive_time_s / wall_time_s`` (0 when the wall time is 0).
    """

    steps_completed: int
    """The final step reached (the last row's step)."""
    steps_executed: int
    """Optimizer steps run in all, re-run ones included (number of metrics rows)."""
    rerun_steps: int
    max_restart_count: int
    attempts: list[Attempt]
    world_sizes: list[tuple[float, int]]
    """``(time_offset_s, world_size)`` at the start and at every world-size change."""
    checkpoints_committed: int
    last_checkpoint_step: int | None
    checkpoint_bytes: int
    checkpoint_mean_duration_s: float | None
    emergency_checkpoints: int
    checkpoints_failed: int
    faults_injected: int
    """``fault`` events from every rank (one per rank that recorded one, not deduplicated)."""
    fallbacks: int
    preemptions: int
    downtime_s: float
    rerun_time_s: float
    time_lost_s: float
    productive_time_s: float
    wall_time_s: float
    goodput: float
    first_loss: float
    final_loss: float
    start_time: float
    """Unix time that every ``*_s`` offset counts from."""
    finished: bool
    """True when an ``finished`` event reached the final step."""
    failures: int = 0
    """Events in :data:`FAILURE_EVENTS`, from every rank."""
    watchdog_stalls: int = 0
    """Events in :data:`WATCHDOG_EVENTS`, from every rank."""
    straggler_reports: int = 0
    """Events in :data:`DETECTOR_EVENTS`, from every rank."""
    fault_ranks: list[int] = field(default_factory=list)
    """Rank of each fault event, in time order (-1 when an event names no rank)."""
    event_ranks: list[int] = field(default_factory=list)
    """Ranks that recorded at least one event, ascending."""
    notes: list[str] = field(default_factory=list)

    @property
    def distinct_attempts(self) -> int:
        return len(self.attempts)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-able dict (attempts as dicts, world sizes as pairs)."""
        out = dataclasses.asdict(self)
        out["distinct_attempts"] = self.distinct_attempts
        out["world_sizes"] = [list(pair) for pair in self.world_sizes]
        return out


def _row_start(row: dict[str, Any]) -> float:
    return float(row["time"]) - float(row.get("step_time_s", 0.0) or 0.0)


def split_attempts(metrics: list[dict[str, Any]], start_time: float) -> list[Attempt]:
    """Group metrics rows (in file order) into attempts; see :class:`Attempt`."""
    attempts: list[Attempt] = []
    group: list[dict[str, Any]] = []

    def close() -> None:
        if group:
            first, last = group[0], group[-1]
            attempts.append(
                Attempt(
                    index=len(attempts),
                    restart_count=int(first.get("restart_count", 0)),
                    world_size=int(first.get("world_size", 1)),
                    first_step=int(first["step"]),
                    last_step=int(last["step"]),
                    rows=len(group),
                    start_s=_row_start(first) - start_time,
                    end_s=float(last["time"]) - start_time,
                )
            )

    for row in metrics:
        if group:
            prev = group[-1]
            if (
                row.get("restart_count", 0) != prev.get("restart_count", 0)
                or row.get("world_size", 1) != prev.get("world_size", 1)
                or int(row["step"]) <= int(prev["step"])
            ):
                close()
                group = []
        group.append(row)
    close()
    return attempts


def rerun_mask(metrics: list[dict[str, Any]]) -> list[bool]:
    """For each row, True when a later row has the same step (its work was thrown away)."""
    seen: set[int] = set()
    mask = [False] * len(metrics)
    for i in range(len(metrics) - 1, -1, -1):
        step = int(metrics[i]["step"])
        mask[i] = step in seen
        seen.add(step)
    return mask


def _emergency_steps(events: list[dict[str, Any]]) -> set[int]:
    """Steps of checkpoints saved for a preemption (``preempted`` with ``emergency_save``)."""
    return {
        int(e.get("step", 0))
        for e in events
        if e.get("event") == ev.PREEMPTED and e.get("emergency_save")
    }


def is_emergency(event: dict[str, Any], emergency_steps: set[int]) -> bool:
    """A ``checkpoint_saved`` event written by an emergency (preemption) save."""
    return bool(event.get("emergency")) or int(event.get("step", -1)) in emergency_steps


def event_rank(event: dict[str, Any]) -> int:
    """The rank that recorded ``event`` (its ``rank`` field; -1 when absent or not a number)."""
    try:
        return int(event.get("rank", -1))
    except (TypeError, ValueError):
        return -1


def _count(events: list[dict[str, Any]], names: frozenset[str]) -> int:
    return sum(e.get("event") in names for e in events)


def summarize(metrics: list[dict[str, Any]], events: list[dict[str, Any]]) -> RunSummary:
    """Summarize one run from its metrics rows and events (every rank's, by time).

    Raises :class:`RunReportError` when there are no metrics rows (nothing ran).
    """
    if not metrics:
        raise RunReportError("no metrics rows: the run did not finish a single optimizer step")
    start_time = _row_start(metrics[0])
    attempts = split_attempts(metrics, start_time)
    mask = rerun_mask(metrics)

    world_sizes: list[tuple[float, int]] = []
    for att in attempts:
        if not world_sizes or world_sizes[-1][1] != att.world_size:
            world_sizes.append((round(att.start_s, 3), att.world_size))

    downtime = sum(max(0.0, nxt.start_s - prev.end_s) for prev, nxt in itertools.pairwise(attempts))
    step_times = [float(r.get("step_time_s", 0.0) or 0.0) for r in metrics]
    rerun_time = sum(t for t, rerun in zip(step_times, mask) if rerun)
    productive = sum(t for t, rerun in zip(step_times, mask) if not rerun)
    wall = float(metrics[-1]["time"]) - start_time

    saved = [e for e in events if e.get("event") == ev.CHECKPOINT_SAVED]
    emergency_steps = _emergency_steps(events)
    durations = [float(e["duration_s"]) for e in saved if "duration_s" in e]
    final_step = int(metrics[-1]["step"])
    faults = [e for e in events if e.get("event") in FAULT_EVENTS]
    failures = _count(events, FAILURE_EVENTS)
    stalls = _count(events, WATCHDOG_EVENTS)
    notes = []
    if len(attempts) > 1 and not (faults or failures or stalls):
        notes.append(
            "restarts without a recorded fault or failure: a rank killed from outside "
            "(OOM killer, SIGKILL, lost host) records nothing"
        )
    return RunSummary(
        steps_completed=final_step,
        steps_executed=len(metrics),
        rerun_steps=sum(mask),
        max_restart_count=max(int(r.get("restart_count", 0)) for r in metrics),
        attempts=attempts,
        world_sizes=world_sizes,
        checkpoints_committed=len(saved),
        last_checkpoint_step=int(saved[-1]["step"]) if saved else None,
        checkpoint_bytes=sum(int(e.get("bytes", 0) or 0) for e in saved),
        checkpoint_mean_duration_s=sum(durations) / len(durations) if durations else None,
        emergency_checkpoints=sum(is_emergency(e, emergency_steps) for e in saved),
        checkpoints_failed=sum(e.get("event") == ev.CHECKPOINT_FAILED for e in events),
        faults_injected=len(faults),
        fallbacks=sum(e.get("event") == ev.FALLBACK for e in events),
        preemptions=sum(e.get("event") == ev.PREEMPTED for e in events),
        downtime_s=downtime,
        rerun_time_s=rerun_time,
        time_lost_s=downtime + rerun_time,
        productive_time_s=productive,
        wall_time_s=wall,
        goodput=productive / wall if wall > 0 else 0.0,
        first_loss=float(metrics[0]["loss"]),
        final_loss=float(metrics[-1]["loss"]),
        start_time=start_time,
        finished=any(
            e.get("event") == ev.FINISHED and int(e.get("step", -1)) == final_step for e in events
        ),
        failures=failures,
        watchdog_stalls=stalls,
        straggler_reports=_count(events, DETECTOR_EVENTS),
        fault_ranks=[event_rank(e) for e in faults],
        event_ranks=sorted({event_rank(e) for e in events} - {-1}),
        notes=notes,
    )


def _fmt_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def transition_label(prev: Attempt, nxt: Attempt) -> str:
    """What ended ``prev`` and started ``nxt``, as the timeline names it.

    torchrun restarts the worker group both after a failure and when a node joins or
    leaves; only a failure uses up a restart (``TORCHELASTIC_RESTART_COUNT`` grows). So
    a new world size at the same restart count is a membership change, not "restart N"
    again; a lower restart count is a new launch of the job.
    """
    resized = nxt.world_size != prev.world_size
    sizes = f"world {prev.world_size} -> {nxt.world_size}"
    if nxt.restart_count > prev.restart_count:
        return f"restart {nxt.restart_count}" + (f", {sizes}" if resized else "")
    if nxt.restart_count < prev.restart_count:
        return "relaunch" + (f", {sizes}" if resized else "")
    return f"membership change, {sizes}" if resized else "membership change"


def world_size_segments(summary: RunSummary) -> list[tuple[int, float, float]]:
    """Consecutive attempts with the same world size merged: ``(world_size, from_s, to_s)``."""
    segments: list[tuple[int, float, float]] = []
    for att in summary.attempts:
        if segments and segments[-1][0] == att.world_size:
            segments[-1] = (att.world_size, segments[-1][1], att.end_s)
        else:
            segments.append((att.world_size, att.start_s, att.end_s))
    return segments


def _ranks(ranks: list[int]) -> str:
    return ", ".join("?" if r < 0 else str(r) for r in ranks)


def _on_ranks(ranks: list[int]) -> str:
    distinct = sorted(set(ranks))
    if not distinct:
        return ""
    return f" (on rank{'s' if len(distinct) > 1 else ''} {_ranks(distinct)})"


def format_summary(summary: RunSummary, run_dir: str = "") -> str:
    """The human-readable block that ``python -m trainer report`` prints."""
    s = summary
    worlds = " -> ".join(f"{w} ({a:.0f}-{b:.0f} s)" for w, a, b in world_size_segments(s))
    if s.checkpoints_committed:
        ckpts = (
            f"{s.checkpoints_committed} committed, last at step {s.last_checkpoint_step}, "
            f"{_fmt_bytes(s.checkpoint_bytes)} in all, mean {s.checkpoint_mean_duration_s:.2f} s"
        )
    else:
        ckpts = "none committed"
    extras = [
        f"{s.emergency_checkpoints} emergency",
        f"{s.checkpoints_failed} failed",
        f"{s.fallbacks} fallbacks",
    ]
    lines = [
        f"Run report{': ' + run_dir if run_dir else ''}",
        f"  steps          {s.steps_completed} reached ({'finished' if s.finished else 'not finished'}); "
        f"{s.steps_executed} executed, {s.rerun_steps} re-run",
        f"  restarts       {s.max_restart_count} (max restart_count); {s.distinct_attempts} attempts seen",
        f"  world sizes    {worlds}",
        f"  checkpoints    {ckpts} ({', '.join(extras)})",
        f"  faults         {s.faults_injected} injected{_on_ranks(s.fault_ranks)}, "
        f"{s.preemptions} preemptions",
        f"  failures       {s.failures} reported, {_plural(s.watchdog_stalls, 'watchdog stall')}, "
        f"{_plural(s.straggler_reports, 'straggler report')}"
        + (f" (events from ranks {_ranks(s.event_ranks)})" if s.event_ranks else ""),
        f"  wall time      {s.wall_time_s:.1f} s (first step start to last step end)",
        f"  time lost      {s.time_lost_s:.1f} s = {s.downtime_s:.1f} s down between attempts "
        f"+ {s.rerun_time_s:.1f} s re-running steps",
        f"  goodput        {100 * s.goodput:.1f} % ({s.productive_time_s:.1f} s productive step time)",
        f"  loss           {s.first_loss:.4f} (step {s.attempts[0].first_step}) -> {s.final_loss:.4f} "
        f"(step {s.steps_completed})",
    ]
    lines += [f"  note: {note}" for note in s.notes]
    return "\n".join(lines)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Read one JSON object per line; a torn last line (a killed writer) is skipped."""
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                logger.warning("%s:%d: skipping a torn last line", path, number)
                continue
            raise RunReportError(f"{path}:{number}: not a JSON line: {line[:80]!r}") from None
    return rows


def event_files(run_dir: str) -> list[tuple[int, str]]:
    """``(rank, path)`` of every event file in ``run_dir``: ``events.jsonl`` (rank 0)
    first, then each ``events.rank{R}.jsonl`` by rank."""
    found: list[tuple[int, str]] = []
    path = os.path.join(run_dir, EVENTS_FILE)
    if os.path.isfile(path):
        found.append((0, path))
    ranked = []
    for path in glob.glob(os.path.join(glob.escape(run_dir), RANK_EVENTS_GLOB)):
        match = _RANK_EVENTS_RE.match(os.path.basename(path))
        if match and os.path.isfile(path):
            ranked.append((int(match.group(1)), path))
    return found + sorted(ranked)


def merge_events(per_rank: list[tuple[int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Every rank's events in one list sorted by ``time`` (stable: ties keep file order).

    An event without a ``rank`` field gets the rank of the file it came from. Nothing
    is deduplicated: the same event name from two ranks is two events.
    """
    merged: list[dict[str, Any]] = []
    for rank, events in per_rank:
        for event in events:
            if "rank" not in event:
                event = {**event, "rank": rank}
            merged.append(event)

    def when(event: dict[str, Any]) -> float:
        try:
            return float(event.get("time", 0.0))
        except (TypeError, ValueError):
            return 0.0

    return sorted(merged, key=when)


def load_run_dir(run_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Read ``(metrics, events)`` from a local run directory; events may be absent.

    ``events`` merges ``events.jsonl`` and every ``events.rank{R}.jsonl`` by time
    (:func:`merge_events`).
    """
    if not os.path.isdir(run_dir):
        raise RunReportError(
            f"run directory {run_dir!r} does not exist (pass the trainer's --run-dir)"
        )
    metrics_path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(metrics_path):
        raise RunReportError(
            f"no {METRICS_FILE} in {run_dir!r}: not a trainer run directory, or rank 0 never started"
        )
    events = merge_events([(rank, read_jsonl(path)) for rank, path in event_files(run_dir)])
    return read_jsonl(metrics_path), events


TIMELINE_MARKS = {
    "fault": FAULT_EVENTS,
    "failure": FAILURE_EVENTS,
    "watchdog": WATCHDOG_EVENTS,
    "fallback": frozenset({ev.FALLBACK}),
    "checkpoint_failed": frozenset({ev.CHECKPOINT_FAILED}),
}
"""Marker kind on the timeline -> the event names drawn with it (besides checkpoints)."""
RANK_LABELLED_MARKS = frozenset({"fault", "failure", "watchdog"})
"""Marker kinds labelled with the rank that recorded the event."""


def timeline_marks(
    events: list[dict[str, Any]], start_time: float
) -> dict[str, list[tuple[float, int, int]]]:
    """Events drawn on the timeline: marker kind -> ``(time offset s, step, rank)``.

    Kinds: ``checkpoint``, ``emergency`` and those of :data:`TIMELINE_MARKS`; events
    of every rank are drawn, each on its own.
    """
    emergency_steps = _emergency_steps(events)
    marks: dict[str, list[tuple[float, int, int]]] = {}
    for e in events:
        name = e.get("event")
        if name == ev.CHECKPOINT_SAVED:
            kind = "emergency" if is_emergency(e, emergency_steps) else "checkpoint"
        else:
            kind = next((k for k, names in TIMELINE_MARKS.items() if name in names), "")
        if kind and "time" in e:
            marks.setdefault(kind, []).append(
                (float(e["time"]) - start_time, int(e.get("step", 0)), event_rank(e))
            )
    return marks


def plot_timeline(
    metrics: list[dict[str, Any]],
    events: list[dict[str, Any]],
    summary: RunSummary,
    out_path: str,
) -> None:
    """Draw the goodput timeline (step vs wall time, loss below) into a 1400x800 PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = summary.start_time
    fig, (ax, ax_loss) = plt.subplots(
        2, 1, figsize=(14, 8), dpi=100, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    colors = plt.get_cmap("tab10").colors
    mask = rerun_mask(metrics)
    offset = 0
    for att in summary.attempts:
        rows = metrics[offset : offset + att.rows]
        lost = mask[offset : offset + att.rows]
        offset += att.rows
        color = colors[att.index % len(colors)]
        xs = [float(r["time"]) - t0 for r in rows]
        ys = [int(r["step"]) for r in rows]
        label = f"attempt {att.index} (restart {att.restart_count}, world {att.world_size})"
        ax.plot(xs, ys, "-", color=color, lw=1.5, alpha=0.8, label=label)
        ax.scatter(
            [x for x, gone in zip(xs, lost) if not gone],
            [y for y, gone in zip(ys, lost) if not gone],
            s=18, color=color, zorder=3,
        )  # fmt: skip
        ax.scatter(
            [x for x, gone in zip(xs, lost) if gone],
            [y for y, gone in zip(ys, lost) if gone],
            s=22, facecolors="white", edgecolors=color, zorder=3,
        )  # fmt: skip
        ax_loss.plot(xs, [float(r["loss"]) for r in rows], ".-", color=color, ms=4, lw=1)
    if len(summary.attempts) > 1:
        ax.fill_between([], [], color="red", alpha=0.08, label="down: restart, rendezvous, load")
    if summary.rerun_steps:
        ax.scatter(
            [], [], s=22, facecolors="white", edgecolors="gray", label="step re-run later (lost)"
        )

    top = max(int(r["step"]) for r in metrics)
    for i, (prev, nxt) in enumerate(itertools.pairwise(summary.attempts)):
        label = "stop / restart" if i == 0 else None
        ax.axvline(prev.end_s, color="red", ls="--", lw=1.2, label=label)
        ax_loss.axvline(prev.end_s, color="red", ls="--", lw=1.2)
        for axis in (ax, ax_loss):
            axis.axvspan(prev.end_s, max(prev.end_s, nxt.start_s), color="red", alpha=0.08, lw=0)
        if nxt.start_s > prev.end_s:
            ax.text(
                (prev.end_s + nxt.start_s) / 2, top * 0.03, f"down\n{nxt.start_s - prev.end_s:.1f} s",
                ha="center", va="bottom", fontsize=10, color="darkred",
            )  # fmt: skip
        ax.annotate(
            f"{transition_label(prev, nxt)}\nresume at step {nxt.first_step - 1}",
            xy=(prev.end_s, top), xytext=(4, -4), textcoords="offset points",
            va="top", ha="left", fontsize=9, color="red",
        )  # fmt: skip
        if nxt.world_size != prev.world_size:
            ax.annotate(
                f"world {prev.world_size} -> {nxt.world_size}",
                xy=(nxt.start_s, nxt.first_step), xytext=(-8, 28), textcoords="offset points",
                ha="right", fontsize=10, fontweight="bold", color="black",
                arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.8},
            )  # fmt: skip

    marks = timeline_marks(events, t0)
    styles = {
        "checkpoint": ({"marker": "^", "color": "green", "s": 55}, "checkpoint committed"),
        "emergency": ({"marker": "*", "color": "darkorange", "s": 180}, "emergency checkpoint"),
        "checkpoint_failed": ({"marker": "v", "color": "purple", "s": 55}, "checkpoint failed"),
        "fault": ({"marker": "X", "color": "red", "s": 90}, "fault injected (any rank)"),
        "failure": ({"marker": "P", "color": "crimson", "s": 80}, "rank failure"),
        "watchdog": ({"marker": "s", "color": "black", "s": 45}, "watchdog stall"),
        "fallback": ({"marker": "D", "color": "brown", "s": 50}, "resume fallback"),
    }
    for kind, (style, label) in styles.items():
        if kind not in marks:
            continue
        xs = [x for x, _, _ in marks[kind]]
        ys = [y for _, y, _ in marks[kind]]
        ax.scatter(xs, ys, zorder=4, edgecolors="black", linewidths=0.5, label=label, **style)
        if kind in RANK_LABELLED_MARKS:
            for x, y, rank in marks[kind]:
                ax.annotate(
                    f"rank {rank}" if rank >= 0 else "rank ?", xy=(x, y), xytext=(6, -10),
                    textcoords="offset points", fontsize=8, color=style["color"],
                )  # fmt: skip

    s = summary
    ax.set_title(
        f"{s.steps_completed} steps ({s.steps_executed} executed), {_plural(s.max_restart_count, 'restart')}, "
        f"{_plural(s.checkpoints_committed, 'checkpoint')}, time lost {s.time_lost_s:.1f} s of "
        f"{s.wall_time_s:.1f} s, goodput {100 * s.goodput:.1f} %\n"
        f"world size {' -> '.join(str(w) for w, _, _ in world_size_segments(s))}",
        fontsize=13,
    )
    ax.set_ylabel("optimizer step")
    ax.set_ylim(bottom=0, top=top * 1.08 + 1)
    ax.grid(alpha=0.3)
    # Outside the axes: steps climb from bottom left to top right, so no inside corner is free.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, borderaxespad=0)
    ax_loss.set_ylabel("loss")
    ax_loss.set_xlabel("wall time since the first step started (s)")
    ax_loss.grid(alpha=0.3)
    ax_loss.set_xlim(left=0)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)


def build_report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer report",
        description="Summarize a run directory (metrics.jsonl, events.jsonl): steps, restarts, "
        "world sizes, checkpoints, time lost to failures, goodput; and draw a timeline PNG.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the trainer's --run-dir")
    parser.add_argument(
        "--out", metavar="PNG", help=f"timeline image path (default: RUN_DIR/{DEFAULT_PLOT_NAME})"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the timeline")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry of ``python -m trainer report``: exit 0, or 2 for a bad directory or arguments."""
    parser = build_report_parser()
    args = parser.parse_args(argv)
    try:
        metrics, events = load_run_dir(args.run_dir)
        summary = summarize(metrics, events)
    except (RunReportError, OSError) as exc:
        parser.error(str(exc))
    out = None
    if not args.no_plot:
        out = args.out or os.path.join(args.run_dir, DEFAULT_PLOT_NAME)
        plot_timeline(metrics, events, summary, out)
    if args.json:
        payload = summary.to_json()
        payload["timeline_png"] = out
        print(json.dumps(payload, indent=2))
    else:
        print(format_summary(summary, args.run_dir))
        if out:
            print(f"  timeline       {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
