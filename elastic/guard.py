"""``RunGuard``: the elastic hooks of a training loop in one ``with``.

    with elastic.RunGuard(saver=manager, faults=args.fault, on_event=recorder.event) as guard:
        start = manager.resume() or 0
        for step in guard.steps(start, max_steps):
            ...                                   # one optimizer step

Before each step it fires the faults planned for (step, rank, attempt) (all kinds of
:mod:`elastic.faults`, ``ckpt-storage`` armed in the saver), and checks for a
termination signal: all ranks agree (one small all_reduce), an emergency checkpoint
of the last finished step is committed if it fits the grace period (the saver's
expected save time, async saves included), then :class:`Preempted` is raised, a
``SystemExit`` with code 128+signal (143 for SIGTERM). After each step it feeds the
watchdog and the straggler monitor. ``check(loss)``, called once the step's loss is known
and before the step is saved, applies the divergence policy to a loss that is not finite
(:mod:`elastic.divergence`: stop with exit code 3, or roll back to the newest checkpoint and
skip the data after it). While the block runs, a peer failure detector
(:mod:`elastic.heartbeat`) heartbeats through the process group's TCP store and ends
this rank (exit 125) when a peer or the store goes silent for ``peer_timeout_s``. The
watchdog is on by default ("auto"): a 600 s bound until five steps are timed, then
10 x their median within [60 s, 600 s]. Events (``fault``, ``preempted``, ``stragglers``)
go to ``on_event(name, step, every_rank=..., **fields)`` on every rank; a run recorder
writes ``every_rank`` events (a fault fired on this rank) on every rank, so a fault on
rank 1 is recorded by rank 1, and the others (agreed by all ranks) on rank 0 only.

An epoch loop numbers its steps with :meth:`RunGuard.batches` instead (``for step,
batch in guard.batches(loader, start)`` in each epoch): the same hooks, each step's
faults and preemption check before its batch is fetched.

An exception that a restart reproduces (``runcore.errors.DeterministicError``: a
checkpoint of other shapes, a data position that does not advance) leaving the ``with``
block is recorded (``deterministic_error`` event) and noted for the job's next attempt;
when that attempt ends with the same error at the same point, every later attempt of
the job ends at its start (:mod:`elastic.repeats`), instead of each one burning a
restart after a full start-up.

The saver is duck-typed (``ckpt.CheckpointManager`` is one): ``expected_save_s() ->
float | None``, ``emergency_save(step) -> bool`` (collective) and
``inject_storage_fault(spec: str)``; for a rollback ``resume()`` (collective: the step
loaded, or None), ``wait()`` and ``last_committed_step``, and for the ``nan`` fault
``inject_non_finite()``; and, if it has one, ``close()``: the guard closes
its saver first thing on exit (the drain of a background save still runs under the
watchdog, heartbeats and SIGTERM handling), so the order of ``with manager`` and
``with guard`` does not matter; a manager's ``close`` is idempotent. ``elastic`` never
imports ``ckpt``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from elastic import divergence as _div
from elastic.errors import Diverged, Preempted
from elastic.faults import SAVER_ACTIONS, FaultPlan, FaultSpec
from elastic.heartbeat import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_PEER_TIMEOUT_S,
    PeerHeartbeat,
    SilentVerdict,
    StallNotice,
    group_heartbeat,
)
from elastic.identity import RunIdentity, job_restart_count, restart_setup_problem
from elastic.nodes import DEFAULT_NODE_TIMEOUT_S, DEFAULT_STALL_LIMIT_S
from elastic.preemption import PreemptionHandler, agree_on_preemption
from elastic.repeats import MAX_MESSAGE_CHARS, ErrorNote, merge_note, note_for, stop_if_repeated
from elastic.straggler import StragglerMonitor
from elastic.watchdog import Watchdog
from runcore import events as ev
from runcore.errors import ends_the_job, is_deterministic

T = TypeVar("T")

logger = logging.getLogger(__name__)

SLOW_PHASE_ALLOWANCE_S = 900.0
"""Watchdog allowance around checkpoint loads and saves and the first step of an attempt."""
AUTO = "auto"
"""``watchdog_s`` value that derives the bound from measured step times."""
AUTO_WATCHDOG_MIN_S = 60.0
AUTO_WATCHDOG_MAX_S = 600.0
"""Bounds of the derived watchdog timeout; the upper one also applies until it is derived."""
AUTO_WATCHDOG_FACTOR = 10.0
AUTO_WATCHDOG_STEPS = 5
"""Step times (wall time between two finished steps, from the second step of the attempt
on) whose median sets the derived bound."""


def auto_watchdog_s(step_times: Sequence[float]) -> float:
    """``AUTO_WATCHDOG_FACTOR`` x the median step time, within [60 s, 600 s]. Pure."""
    if not step_times:
        return AUTO_WATCHDOG_MAX_S
    ordered = sorted(step_times)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return min(AUTO_WATCHDOG_MAX_S, max(AUTO_WATCHDOG_MIN_S, AUTO_WATCHDOG_FACTOR * median))


def parse_watchdog_s(value: float | str) -> float | None:
    """``"auto"`` -> None (derive from step times); a number >= 0 -> itself (0: off)."""
    if isinstance(value, str):
        if value.strip().lower() == AUTO:
            return None
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"watchdog_s must be 'auto' or seconds >= 0, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"watchdog_s must be 'auto' or seconds >= 0, got {value!r}")
    return float(value)


class EmergencySaver(Protocol):
    """What :class:`RunGuard` needs from a checkpoint manager."""

    def expected_save_s(self) -> float | None: ...

    def emergency_save(self, step: int) -> bool: ...

    def inject_storage_fault(self, spec: str) -> None: ...

    def inject_non_finite(self) -> list[str]: ...


class RunGuard:
    """Fault plan, preemption, watchdog and straggler report around a training loop.

    Build it on every rank at the same point, after the process group exists (the
    job-wide restart count is a collective) and in the main thread (signal handlers).

    ``faults``: ``--fault`` specs (the ``TRAINER_FAULTS`` environment variable is added).
    ``watchdog_s``: dump every thread's stack and exit when no step finishes for that
    long (0: off; ``"auto"``, the default: 10 x the median of the first timed steps,
    within [60 s, 600 s], 600 s until then); loads, saves and the first step get
    ``slow_phase_s`` more.
    ``peer_timeout_s``: leave (exit 125) when a peer's heartbeat or the store has been
    silent this long (0: off); ``heartbeat_s``: seconds between heartbeats. On when the
    default process group has more than one rank and a TCP store (torchrun's). Under
    ``--rdzv_backend=ft`` the peers' node keep-alives are read too (:mod:`elastic.nodes`):
    a peer whose node stopped as well is silent after ``node_timeout_s`` (0: never read
    them); one whose node lives is stalled, said at WARNING (event ``peer_stalled``) and
    waited for up to ``stall_limit_s``.
    ``straggler_every``: compare step times across ranks every N steps (0: off).
    ``grace_s``: seconds between the signal and SIGKILL (default: from the environment,
    see :func:`elastic.preemption.grace_from_env`).
    ``divergence``: what :meth:`check` does with a loss that is not finite: ``"stop"``
    (default) or ``"rollback"`` (needs ``saver`` and ``sampler``: the data position with
    ``advance()``), which skips ``rollback_skip`` global batches (``"auto"``: those trained
    since the restored checkpoint) at most ``max_rollbacks`` times.
    """

    def __init__(
        self,
        *,
        saver: EmergencySaver | None = None,
        faults: Sequence[str] = (),
        on_event: Callable[..., None] | None = None,
        watchdog_s: float | str = AUTO,
        dump_dir: str | None = None,
        straggler_every: int = 0,
        slow_phase_s: float = SLOW_PHASE_ALLOWANCE_S,
        grace_s: float | None = None,
        rank: int | None = None,
        attempt: int | None = None,
        process_group: Any = None,
        env: Mapping[str, str] | None = None,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
        node_timeout_s: float = DEFAULT_NODE_TIMEOUT_S,
        stall_limit_s: float = DEFAULT_STALL_LIMIT_S,
        divergence: str = _div.STOP,
        rollback_skip: int | str = _div.AUTO,
        max_rollbacks: int = 3,
        sampler: Any = None,
    ) -> None:
        identity = RunIdentity.from_env(env)
        stop_if_repeated(identity)  # this job's deterministic error repeated: end at once
        self._notes = note_for(identity)
        self.plan = FaultPlan.from_args_and_env(faults, env)
        from elastic.distributed import prepare_child_processes  # imports torch

        prepare_child_processes()  # loader workers started from now on outlive a SIGTERM
        self.saver = saver
        self._on_event = on_event
        self.process_group = process_group
        if rank is None:
            rank = _dist_rank(identity.rank)
        self.rank = rank
        self.attempt = job_restart_count(identity, process_group) if attempt is None else attempt
        fixed = parse_watchdog_s(watchdog_s)
        self.watchdog_auto = fixed is None
        self.watchdog_s: float = AUTO_WATCHDOG_MAX_S if fixed is None else fixed
        if peer_timeout_s < 0 or not math.isfinite(peer_timeout_s):
            raise ValueError(f"peer_timeout_s must be seconds >= 0, got {peer_timeout_s!r}")
        if node_timeout_s < 0 or not math.isfinite(node_timeout_s):
            raise ValueError(f"node_timeout_s must be seconds >= 0, got {node_timeout_s!r}")
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.node_timeout_s = node_timeout_s
        self.stall_limit_s = stall_limit_s
        self.run_id = identity.run_id
        self.dump_dir = dump_dir or tempfile.gettempdir()
        self.slow_phase_s = slow_phase_s
        self.stragglers = StragglerMonitor(straggler_every) if straggler_every else None
        self._grace_s = grace_s
        self._env = env
        self.preemption: PreemptionHandler | None = None
        self.watchdog: Watchdog | None = None
        self.heartbeat: PeerHeartbeat | None = None
        self._stack = contextlib.ExitStack()
        self._step_time_s: float | None = None
        self._step = 0
        self._last_finished: float | None = None
        self._step_gaps: list[float] = []
        self._prepared = 0
        """The last step whose :meth:`before_step` ran (an epoch's end runs one ahead)."""
        self._stepped = False
        self._last_step = 0
        self.divergence = _div.DivergencePolicy.of(divergence, rollback_skip, max_rollbacks)
        self.sampler = sampler
        self.rollbacks = 0
        """Rollbacks done by this process (``divergence="rollback"``)."""
        self._resume_at: int | None = None
        if self.divergence.action == _div.ROLLBACK:
            if not callable(getattr(saver, "resume", None)):
                raise ValueError(
                    "divergence='rollback' needs a saver that can resume (a ckpt.CheckpointManager)"
                )
            if not callable(getattr(sampler, "advance", None)):
                raise ValueError(
                    "divergence='rollback' needs sampler= (an elastic.ElasticSampler: the data "
                    "position whose next batches a rollback skips)"
                )

    # -- lifetime --------------------------------------------------------------------------

    def __enter__(self) -> RunGuard:
        problem = restart_setup_problem(self._env)
        if problem is not None and self.rank == 0:
            logger.warning("rank 0: %s", problem)  # the most common way a restarted job hangs
        self.preemption = self._stack.enter_context(PreemptionHandler(self._grace_s, env=self._env))
        if self.watchdog_s > 0:
            self.watchdog = self._stack.enter_context(
                Watchdog(self.watchdog_s, self.dump_dir, on_stall=self._on_stall, rank=self.rank)
            )
        self.heartbeat = self._start_heartbeat()
        if self.heartbeat is not None:
            self._stack.callback(self.heartbeat.stop)
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            close = getattr(self.saver, "close", None)
            if callable(close):
                close()  # drain a background save while still guarded
        finally:
            self._stack.close()
            self.preemption = self.watchdog = self.heartbeat = None
            if is_deterministic(exc):
                self._note_deterministic(exc)  # type: ignore[arg-type]
            elif exc is None and self._notes is not None:
                self._notes.clear()

    def _note_deterministic(self, exc: BaseException) -> None:
        """Record an error a restart reproduces, and say whether it repeats the last one."""
        message = " ".join(str(exc).split())[:MAX_MESSAGE_CHARS]
        note = ErrorNote(
            error=type(exc).__name__,
            point=f"step {self._step}" if self._step else "start-up",
            message=message,
            restart_count=self.attempt,
        )
        previous = self._notes.read() if self._notes is not None else None
        ends_job = ends_the_job(exc)
        repeated = merge_note(previous, note, ends_job=ends_job).repeated
        if self._notes is not None:
            self._notes.write(dataclasses.replace(note, repeated=repeated))
        self.event(
            ev.DETERMINISTIC_ERROR,
            self._step,
            error=note.error,
            point=note.point,
            message=message,
            repeated=repeated,
            restart_count=self.attempt,
        )
        if self.rank != 0:
            return
        if ends_job and self._notes is not None:
            logger.error(
                "rank 0: %s at %s: a restart cannot fix it and must not retry it, so this "
                "job's remaining restarts end at start-up. Fix the cause and launch again",
                note.error, note.point,
            )  # fmt: skip
        elif repeated:
            logger.error(
                "rank 0: %s at %s again, as in the attempt before: a restart runs the same "
                "code on the same checkpoint and cannot fix it, so this job's remaining "
                "restarts end at start-up. Fix the cause and launch again",
                note.error, note.point,
            )  # fmt: skip
        elif self._notes is not None:
            logger.error(
                "rank 0: %s at %s is an error a restart reproduces; if the next attempt "
                "meets it at the same point, the job's later attempts end at start-up",
                note.error, note.point,
            )  # fmt: skip

    def _start_heartbeat(self) -> PeerHeartbeat | None:
        """The peer failure detector, when a process group of 2+ ranks with a TCP store
        exists: the one ``elastic.init_distributed`` started for the start-up, taken over
        with this guard's settings, else a new one."""
        from elastic.distributed import take_startup_detector  # imports torch

        startup = take_startup_detector(self.run_id, self.attempt)
        if startup is not None:
            if self.peer_timeout_s <= 0:
                startup.stop()  # off for this run: the start-up detector leaves too
                return None
            startup.configure(
                interval_s=self.heartbeat_s,
                timeout_s=self.peer_timeout_s,
                on_silent=self._on_peer_silent,
                node_timeout_s=self.node_timeout_s,
                stall_limit_s=self.stall_limit_s,
                on_stall=self._on_peer_stalled,
            )
            return startup
        return group_heartbeat(
            run_id=self.run_id,
            attempt=self.attempt,
            interval_s=self.heartbeat_s,
            timeout_s=self.peer_timeout_s,
            on_silent=self._on_peer_silent,
            env=self._env,
            node_timeout_s=self.node_timeout_s,
            stall_limit_s=self.stall_limit_s,
            on_stall=self._on_peer_stalled,
        )

    def _on_peer_silent(self, verdict: SilentVerdict) -> None:
        self.event(ev.PEER_SILENT, self._step, every_rank=True, rank=self.rank, **verdict.fields())

    def _on_peer_stalled(self, notice: StallNotice) -> None:
        self.event(ev.PEER_STALLED, self._step, every_rank=True, rank=self.rank, **notice.fields())

    def event(self, name: str, step: int, *, every_rank: bool = False, **fields: Any) -> None:
        """Record an event: a fact of this rank alone (``every_rank``: a fault fired here) is
        written by every rank; one the ranks agree on (preempted, stragglers) by rank 0."""
        if self._on_event is not None:
            self._on_event(name, step, every_rank=every_rank, **fields)

    def _on_stall(self, info: Any) -> None:
        self.event(
            ev.WATCHDOG_STALL,
            info.step or 0,
            every_rank=True,
            stalled_s=round(info.stalled_s, 3),
            dump_path=info.dump_path,
            rank=self.rank,
        )

    def slow_phase(self, seconds: float | None = None) -> contextlib.AbstractContextManager[None]:
        """A block the watchdog allows ``seconds`` more for (load, save, first step)."""
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.allow(self.slow_phase_s if seconds is None else seconds)

    # -- the loop --------------------------------------------------------------------------

    def steps(self, start: int, stop: int) -> Iterator[int]:
        """Yield ``start+1 .. stop``, with :meth:`before_step` and :meth:`after_step` around
        each; the first step of the attempt runs under the slow-phase allowance."""
        step, first = start, start + 1
        while step < stop:
            step += 1
            self.before_step(step)
            with self._timed(step, first=step == first):
                yield step
            if self._resume_at is not None:  # check() rolled back: go on after that step
                step, self._resume_at = self._resume_at, None
                first = step + 1

    def batches(self, loader: Iterable[T], start: int) -> Iterator[tuple[int, T]]:
        """Yield ``(step, batch)`` for each batch of ``loader``: the epoch-loop form of :meth:`steps`.

        ``start`` is the step the run resumed from (``manager.resume() or 0``): steps are
        numbered on from it, and from the last step this guard handed out, so the same
        call in every epoch continues the count (``for step, batch in
        guard.batches(loader, start)``; :attr:`last_step` after the loops). Each step's
        faults and preemption check run before its batch is fetched, so an emergency
        save never counts a batch that was not trained on (an epoch loader moves its
        cursor at the fetch); the check for the step after an epoch's last batch runs
        once, at the end of that epoch.
        """
        iterator = iter(loader)
        self._last_step = step = max(start, self._last_step)
        while True:
            step += 1
            if self._prepared != step:
                self.before_step(step)
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self._last_step = step
            with self._timed(step, first=not self._stepped):
                yield step, batch
            if self._resume_at is not None:  # check() rolled back: this epoch's batches end
                self._last_step, self._resume_at = self._resume_at, None
                return  # the next loop over the loader starts at the restored data position

    @property
    def last_step(self) -> int:
        """The last step :meth:`batches` handed out (its ``start`` before the first)."""
        return self._last_step

    @contextlib.contextmanager
    def _timed(self, step: int, *, first: bool) -> Iterator[None]:
        """The body of one step: timed, under the slow-phase allowance when it is the
        attempt's first, then :meth:`after_step` (not when the body raised)."""
        self._step_time_s = None
        self._stepped = True
        started = time.perf_counter()
        with self.slow_phase() if first else contextlib.nullcontext():
            yield
        measured = time.perf_counter() - started
        self.after_step(step, measured if self._step_time_s is None else self._step_time_s)

    def record_step_time(self, seconds: float) -> None:
        """Inside :meth:`steps`: the compute time of this step, for the straggler report
        (default: the whole loop body, checkpoint saves included)."""
        self._step_time_s = seconds

    def before_step(self, step: int) -> None:
        """Fire the faults planned for ``step``, then act on an agreed termination signal.

        Collective (the preemption agreement): every rank calls it at every step.
        Raises :class:`Preempted` after any emergency save of step ``step - 1``.
        """
        self._step = step
        self._prepared = step
        for spec in self.plan.saver_faults_due(step, self.rank, self.attempt):
            self.event(ev.FAULT, step, every_rank=True, spec=str(spec), rank=self.rank)
            act = SAVER_ACTIONS[spec.kind]
            if self.saver is None:
                raise ValueError(f"fault {spec} needs a checkpoint manager (RunGuard(saver=...))")
            act(self.saver, spec)
        self.plan.fire(step, self.rank, self.attempt, on_fire=self._on_fault(step))
        with self.slow_phase():
            self._stop_if_preempted(step - 1)

    def _on_fault(self, step: int) -> Callable[[FaultSpec], None]:
        def record(spec: FaultSpec) -> None:
            self.event(ev.FAULT, step, every_rank=True, spec=str(spec), rank=self.rank)

        return record

    def _stop_if_preempted(self, done_step: int) -> None:
        assert self.preemption is not None, "use RunGuard in a with block"
        decision = None
        if self.preemption.requested:
            expected = self.saver.expected_save_s() if self.saver is not None else None
            decision = self.preemption.decide(expected)
        agreed = agree_on_preemption(decision, self.process_group)
        if agreed is None:
            return
        saved = False
        if agreed.save and self.saver is not None and done_step > 0:
            saved = self.saver.emergency_save(done_step)
        if self.rank == 0:  # said before the exit: torchrun reports the group as failed
            signal_name = self.preemption.signal_name or "SIGTERM"
            if saved:
                logger.warning(
                    "rank 0: %s: emergency checkpoint committed at step %d; a relaunch resumes "
                    "from it",
                    signal_name,
                    done_step,
                )
            else:
                if not agreed.save:
                    why = agreed.reason
                elif self.saver is None:
                    why = "no checkpoint saver attached"
                elif done_step == 0:
                    why = "no step finished yet"
                else:
                    why = "the emergency save failed, see the error above"
                logger.warning(
                    "rank 0: %s: stopping after step %d without an emergency checkpoint (%s); "
                    "a relaunch resumes from the newest committed checkpoint",
                    signal_name,
                    done_step,
                    why,
                )
        self.event(ev.PREEMPTED, done_step, reason=agreed.reason, emergency_save=saved)
        raise Preempted(done_step, self.preemption.signal_name or "SIGTERM", saved)

    def check(self, loss: Any, *, reduced: bool = False) -> bool:
        """Act on a loss that is not finite; call it once per step, after the step's loss is
        known and before the step is saved. Collective (one small all_reduce) unless
        ``reduced``: the loss is already the same on every rank (all-reduced).

        Returns False for a finite loss. Otherwise applies the policy: ``stop`` raises
        :class:`~elastic.errors.Diverged` on every rank (exit code 3; the message names the
        step, the last checkpoint and how to resume); ``rollback`` restores the newest
        checkpoint on every rank, skips the next global batches through the sampler, says so
        at WARNING, records a ``rolled_back`` event and returns True: leave the step there
        (``continue``) and start a fresh iterator over the data; :meth:`steps` goes on after
        the restored step. Reads the loss on the host (one device sync).
        """
        detach = getattr(loss, "detach", None)  # a tensor that requires grad: no torch warning
        value = float(detach() if detach is not None else loss)
        bad = not math.isfinite(value)
        if not reduced:
            from elastic.collectives import all_reduce_max_ints  # torch, only when needed

            bad = bool(all_reduce_max_ints([int(bad)], self.process_group)[0])
        if not bad:
            return False
        return self._diverged(self._step, value)

    def _diverged(self, step: int, loss: float) -> bool:
        """Every rank: the loss of ``step`` was not finite on some rank."""
        with self.slow_phase():
            last, last_url = self._drain_saver()
        action, why = _div.decide(self.divergence, self.rollbacks, last)
        restored = None
        if action == _div.ROLLBACK:
            with self.slow_phase():
                restored = self.saver.resume()  # type: ignore[union-attr]  # collective
            if restored is None:
                action, why = _div.STOP, "nothing to roll back to"
        self.event(
            ev.DIVERGED,
            step,
            loss=str(loss),
            policy=self.divergence.action,
            action=action,
            last_checkpoint_step=last,
            rollbacks=self.rollbacks,
        )
        if restored is None:
            raise self._stop(step, loss, last, last_url, why)
        skip = _div.batches_to_skip(self.divergence, step, restored)
        first = int(getattr(self.sampler, "cursor", 0))
        for _ in range(skip):
            self.sampler.advance()
        positions = [first, int(getattr(self.sampler, "cursor", 0))]
        self.rollbacks += 1
        if self.rank == 0:
            logger.warning(
                "rank 0 step %d: the loss is %s: rolled back to step %d (the newest checkpoint) "
                "and skipped %d global batch(es), sample positions [%d, %d); rollback %d of at "
                "most %d (divergence=rollback)",
                step, loss, restored, skip, positions[0], positions[1], self.rollbacks,
                self.divergence.max_rollbacks,
            )  # fmt: skip
        self.event(
            ev.ROLLED_BACK,
            restored,
            from_step=step,
            to_step=restored,
            skipped_batches=skip,
            skipped_positions=positions,
            rollbacks=self.rollbacks,
        )
        self._resume_at = restored
        return True

    def _drain_saver(self) -> tuple[int | None, str]:
        """Wait for a save in flight (collective); the newest checkpoint's step (or None)
        and URL."""
        wait = getattr(self.saver, "wait", None)
        url = wait() if callable(wait) else None
        step = getattr(self.saver, "last_committed_step", None)
        return (None if step is None else int(step)), str(url or "")

    def _stop(self, step: int, loss: float, last: int | None, url: str, why: str) -> Diverged:
        if last is None:
            where = "There is no checkpoint to resume from (a relaunch starts from step 0)"
        else:
            where = (
                f"The last checkpoint is step {last}{f' ({url})' if url else ''}; committed "
                "checkpoints are never non-finite (a save refuses NaN and inf)"
            )
        message = (
            f"step {step}: the loss is {loss}: training diverged; stopping ({why}). {where}. "
            "To resume, remove the cause (a lower learning rate, gradient clipping, the data "
            f"near step {step}) and relaunch: it resumes from the newest committed checkpoint; "
            "or relaunch with divergence=rollback (trainer: --set run.divergence=rollback) to "
            "restore it and skip the batches that led here"
        )
        if self.rank == 0:
            logger.error("rank 0: %s", message)
        return Diverged(step, message, last)

    def after_step(self, step: int, step_time_s: float) -> None:
        """Feed the watchdog; every ``straggler_every`` steps compare step times (collective)."""
        if self.watchdog is not None:
            self.watchdog.beat(step)
            if self.watchdog_auto:
                self._derive_watchdog_bound()
        if self.stragglers is not None:
            report = self.stragglers.record(step_time_s)
            if report and report["stragglers"]:
                self.event(ev.STRAGGLERS, step, **report)

    def _derive_watchdog_bound(self) -> None:
        """With ``watchdog_s="auto"``: time the steps after the first of the attempt, then
        set the bound once."""
        if len(self._step_gaps) >= AUTO_WATCHDOG_STEPS or self.watchdog is None:
            return  # derived already
        now = time.monotonic()
        if self._last_finished is not None:
            self._step_gaps.append(now - self._last_finished)
        self._last_finished = now
        if len(self._step_gaps) < AUTO_WATCHDOG_STEPS:
            return
        bound = auto_watchdog_s(self._step_gaps)
        self.watchdog.set_timeout(bound)
        self.watchdog_s = bound
        if self.rank == 0:
            logger.info(
                "rank 0: watchdog bound %.0fs (10 x the median of %d step times, %.2fs; "
                "within [%.0f, %.0f]s)",
                bound, len(self._step_gaps), sorted(self._step_gaps)[len(self._step_gaps) // 2],
                AUTO_WATCHDOG_MIN_S, AUTO_WATCHDOG_MAX_S,
            )  # fmt: skip


def _dist_rank(default: int) -> int:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return default
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else default
