"""Asynchronous saves: stage the state in host memory, upload and commit in the background.

``ckpt.save(..., async_save=True)`` calls :meth:`AsyncSaver.submit` after the caller's thread
has done everything that must not run concurrently with training (argument checks,
creating the checkpoint gloo group, which is a collective on the default group).
:meth:`AsyncSaver.submit` copies every tensor of the state into host memory (DTensors stay
DTensors with the same mesh and placements; the copy buffers of the previous save
are reused when shapes and dtypes match), then runs the synchronous save protocol
on that copy in one background thread and returns a :class:`PendingSave`.

Rules, on every rank alike:

- at most one save is in flight per :class:`AsyncSaver` (the process default behind
  :func:`ckpt.save`, or a manager's own): a save (async or not) first waits for the
  previous one (:meth:`AsyncSaver.wait_for_previous`);
- the background thread runs collectives only on the checkpoint group (see
  :mod:`ckpt.dist`), so training collectives on other groups go on meanwhile;
- COMPLETE is written by the coordinator only after every rank's shards are durable
  (the protocol of :mod:`ckpt.saving.commit`, unchanged);
- a failure is never silent: it is raised by :meth:`PendingSave.wait`, or else by
  the next save, :func:`wait_pending` or :func:`close`; a process that exits with a
  save in flight waits for it and logs a failure nobody observed.

DCP's own ``async_save`` runs only ``dcp.save`` in its executor; our protocol wraps
it with collectives before and after (identities, fencing, manifest, COMPLETE), so
the whole protocol runs on our thread instead.

Call :func:`close` before ``destroy_process_group``: the background save needs the
checkpoint group until it finishes.
"""

from __future__ import annotations

import atexit
import copy
import io
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckpt import env
from ckpt.defaults import created, process_defaults

HOUSEKEEPING_JOIN_S = 120.0
"""How long :meth:`AsyncSaver.close` waits for retention still deleting old checkpoints."""

logger = logging.getLogger(__name__)

_SAVER = "async_save.saver"
"""The key of the one-off functions' saver in ``ckpt.defaults``."""

SaveRunner = Callable[[dict[str, Any], float], str]


class PendingSave:
    """Handle of one asynchronous save: ``wait()`` returns the committed URL or raises."""

    def __init__(self, step: int, url: str, blocking_s: float, started: float) -> None:
        self.step = step
        self.url = url
        self.blocking_s = blocking_s
        """Seconds the ``ckpt.save`` call blocked its caller."""
        self.gate_wait_s = 0.0
        """Seconds optimizer steps waited for a background staging copy (``overlap_staging``)."""
        self.staging_s: float | None = None
        """Seconds the staging copy took (``None`` until it is done)."""
        self.duration_s: float | None = None
        """Seconds from the ``ckpt.save`` call to the end of the commit (``None`` until done)."""
        self._started = started
        self._staged = threading.Event()
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._observed = False

    def staged(self) -> bool:
        """Whether the state has been copied; from then on the caller may change it."""
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the staging copy is done (the caller may then change its tensors)."""
        if not self._staged.wait(timeout):
            raise TimeoutError(
                f"async save of step {self.step}: staging still running after {timeout} s"
            )

    def done(self) -> bool:
        """Whether the background upload and commit have finished (successfully or not)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until committed and return the URL; raise the save's error if it failed.

        Raises :class:`TimeoutError` if it is still running after ``timeout`` seconds.
        An error raised here is not raised again by the next save.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(
                f"async save of step {self.step} to {self.url} still running after {timeout} s"
            )
        if self._error is not None:
            self._observed = True
            raise self._error
        return self.url

    def _run(
        self, runner: SaveRunner, staged: dict[str, Any], copies: list[_Copy], nice: int
    ) -> None:
        lower_thread_priority(nice)
        try:
            if copies:
                started = time.monotonic()
                try:
                    _run_copies(copies)
                finally:
                    self.staging_s = time.monotonic() - started
                    self._staged.set()
            runner(staged, self.blocking_s)
        except BaseException as exc:  # kept for the caller; a thread has nobody to raise to
            logger.debug("ckpt: async save of step %d failed", self.step, exc_info=True)
            self._error = exc
        finally:
            self.duration_s = time.monotonic() - self._started
            self._staged.set()
            self._finished.set()

    def _gate(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook: the step must not change tensors still being copied."""
        if self._staged.is_set():
            return
        started = time.monotonic()
        self._staged.wait()
        self.gate_wait_s += time.monotonic() - started

    def _take_unobserved_error(self) -> BaseException | None:
        if self._error is None or self._observed:
            return None
        self._observed = True
        return self._error

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "committed")
        return f"PendingSave(step={self.step}, url={self.url!r}, {state})"


class AsyncSaver:
    """The asynchronous-save state of one owner: the save in flight, staging buffers, gates.

    A :class:`ckpt.CheckpointManager` owns one; the thin :func:`ckpt.save` uses the
    process default (:func:`default_saver`). At most one save per saver is in flight.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: PendingSave | None = None
        self._staging_buffer: Any = None
        self._atexit_registered = False
        self._gate_handles: list[Any] = []
        self._housekeeping: list[threading.Thread] = []
        self.said_left_alone: set[str] = set()
        """URLs retention left in place and said so (at WARNING once each, not per prune)."""

    @property
    def pending(self) -> PendingSave | None:
        """The last save submitted (finished or not), ``None`` before the first."""
        return self._pending

    def submit(
        self,
        state: dict[str, Any],
        runner: SaveRunner,
        *,
        step: int,
        url: str,
        started: float,
        overlap_with: Sequence[torch.optim.Optimizer] = (),
    ) -> PendingSave:
        """Stage ``state`` in host memory, start ``runner(staged, blocking_s)`` in the background.

        Called by :func:`ckpt.save` on every rank, after :meth:`wait_for_previous`.

        With ``overlap_with`` (optimizers), only the structure is captured here (Python
        objects copied, host buffers allocated); the tensor copies run first thing on the
        background thread, overlapping the caller's forward and backward passes, and a
        step pre-hook on each optimizer makes its next ``step()`` wait until they are done.
        """
        nice = save_thread_nice()  # a bad value raises here, in the caller's thread
        with self._lock:
            if self._pending is not None and not self._pending.done():
                raise RuntimeError("ckpt: an async save is still in flight; call wait_for_previous")
            self._remove_gates()
            copies: list[_Copy] = []
            staged = plan_staging(state, self._staging_buffer, copies)
            self._staging_buffer = staged
            if not overlap_with:
                _run_copies(copies)
                copies = []
            blocking_s = time.monotonic() - started
            pending = PendingSave(step, url, blocking_s, started)
            if overlap_with:
                self._gate_handles.extend(
                    opt.register_step_pre_hook(pending._gate) for opt in overlap_with
                )
            else:
                pending.staging_s = blocking_s
                pending._staged.set()
            self._pending = pending
            if not self._atexit_registered:
                atexit.register(self._drain_at_exit)
                self._atexit_registered = True
        thread = threading.Thread(
            target=pending._run,
            args=(runner, staged, copies, nice),
            name=f"ckpt-save-{step}",
            daemon=True,
        )
        thread.start()
        return pending

    def _remove_gates(self) -> None:
        # Only from the caller's thread (never while it may be inside optimizer.step()).
        while self._gate_handles:
            self._gate_handles.pop().remove()

    def wait_for_previous(self, step: int | None = None) -> None:
        """Wait for the save in flight, if any; raise its error unless already observed.

        ``step`` is the step of the save about to start (named in the error's note).
        """
        with self._lock:
            pending = self._pending
        if pending is None:
            return
        pending._finished.wait()
        error = pending._take_unobserved_error()
        if error is not None:
            caller = f"ckpt.save(step={step})" if step is not None else "ckpt"
            error.add_note(
                f"raised by {caller}: the asynchronous save of step {pending.step} to "
                f"{pending.url} failed in the background; that checkpoint was not committed"
            )
            raise error

    def wait_pending(self, timeout: float | None = None) -> str | None:
        """Wait for the async save in flight; return its URL (``None`` if there was none).

        Raises the save's error unless it was already raised elsewhere, and
        :class:`TimeoutError` if it is still running after ``timeout`` seconds.
        """
        with self._lock:
            pending = self._pending
        if pending is None:
            return None
        if not pending._finished.wait(timeout):
            raise TimeoutError(
                f"async save of step {pending.step} to {pending.url} still running after "
                f"{timeout} s"
            )
        error = pending._take_unobserved_error()
        if error is not None:
            raise error
        return None if pending._error is not None else pending.url

    def start_housekeeping(self, target: Callable[[], None], name: str) -> None:
        """Run ``target`` (retention after a commit) on a daemon thread :meth:`close` joins."""
        thread = threading.Thread(target=target, name=name, daemon=True)
        with self._lock:
            self._housekeeping = [t for t in self._housekeeping if t.is_alive()]
            self._housekeeping.append(thread)
        thread.start()

    def join_housekeeping(self, timeout: float | None = HOUSEKEEPING_JOIN_S) -> None:
        """Wait for retention threads, so a finished run leaves what the policy says.

        Bounded: a prune cut short by the exit is safe (COMPLETE goes first) and the
        next one finishes it.
        """
        with self._lock:
            threads, self._housekeeping = self._housekeeping, []
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning(
                    "ckpt: retention still running after %.0f s at close; the next prune "
                    "finishes it",
                    timeout,
                )

    def close(self, timeout: float | None = None) -> str | None:
        """Drain like :meth:`wait_pending`, wait for retention, free the staging buffer.

        Every rank calls it, before ``destroy_process_group``.
        """
        try:
            url = self.wait_pending(timeout)
            self.join_housekeeping()
            return url
        finally:
            with self._lock:
                if self._pending is None or self._pending.done():
                    self._staging_buffer = None
                    self._remove_gates()

    def _drain_at_exit(self) -> None:
        with self._lock:
            pending = self._pending
        if pending is None:
            return
        if not pending.done():
            logger.warning("ckpt: waiting for the async save of step %d before exit", pending.step)
        pending._finished.wait()
        error = pending._take_unobserved_error()
        if error is not None:
            logger.error(
                "ckpt: the async save of step %d to %s failed and nobody waited for it: %s: %s",
                pending.step,
                pending.url,
                type(error).__name__,
                error,
            )


def default_saver() -> AsyncSaver:
    """The saver of the module-level :func:`ckpt.save` (``ckpt.defaults``; a manager owns its own)."""
    return process_defaults().part(_SAVER, AsyncSaver)


def wait_pending(timeout: float | None = None) -> str | None:
    """Wait for the async save in flight; return its URL (``None`` if there was none).

    Raises the save's error unless it was already raised elsewhere, and
    :class:`TimeoutError` if it is still running after ``timeout`` seconds.
    """
    return default_saver().wait_pending(timeout)


def close(timeout: float | None = None) -> str | None:
    """Drain the default saver like :func:`wait_pending`, then free its staging buffer.

    Every rank calls it, before ``destroy_process_group``. Creates nothing when no
    one-off function ran in this process.
    """
    defaults = created()
    saver = None if defaults is None else defaults.existing(_SAVER)
    return None if saver is None else saver.close(timeout)


def save_thread_nice() -> int:
    """The nice value of background checkpoint threads (``CKPT_SAVE_THREAD_NICE``, 19)."""
    return env.get_int(env.SAVE_THREAD_NICE, 19, minimum=0)


def lower_thread_priority(nice: int) -> None:
    """Make the save thread (and threads it starts) yield the CPU to training threads.

    Linux keeps a nice value per thread; raising our own needs no privilege. The save
    then takes the cores' idle time first instead of slowing the training steps.
    """
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except OSError:
        pass


_Copy = tuple[torch.Tensor, torch.Tensor]  # (host buffer, source)


@torch.no_grad()
def stage_state(state: Any, reuse: Any = None) -> Any:
    """A host-memory copy of ``state`` that later changes to ``state`` do not affect.

    Tensors are copied into CPU tensors (DTensors into DTensors of the same spec);
    where ``reuse`` (a previous result) has a CPU tensor of the same shape and dtype
    at the same place, it is overwritten instead of allocating a new one.
    """
    copies: list[_Copy] = []
    staged = plan_staging(state, reuse, copies)
    _run_copies(copies)
    return staged


def plan_staging(state: Any, reuse: Any, copies: list[_Copy]) -> Any:
    """The staged structure, with every tensor's host buffer allocated but not yet filled.

    Non-tensor values are copied now; ``copies`` receives ``(buffer, source)`` pairs
    that :func:`_run_copies` fills (``torch.empty`` does not touch its pages, so the
    first save's page faults happen in the copy, wherever that runs).
    """
    return _stage(state, reuse, copies)


@torch.no_grad()
def _run_copies(copies: list[_Copy]) -> None:
    accelerator = False
    for buf, src in copies:
        on_device = src.device.type != "cpu"
        accelerator = accelerator or on_device
        buf.copy_(src, non_blocking=on_device)
    if accelerator and torch.cuda.is_available():
        torch.cuda.synchronize()  # non-blocking device-to-host copies must land first


def _stage(obj: Any, old: Any, copies: list[_Copy]) -> Any:
    if isinstance(obj, DTensor):
        old_local = old._local_tensor if isinstance(old, DTensor) else None
        local = _stage_tensor(obj._local_tensor, old_local, copies)
        return DTensor(local, obj._spec, requires_grad=False)
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            return copy.deepcopy(obj)  # other tensor subclasses (ShardedTensor): as they are
        return _stage_tensor(obj, old if isinstance(old, torch.Tensor) else None, copies)
    if isinstance(obj, dict):
        olds = old if isinstance(old, dict) else {}
        return {key: _stage(value, olds.get(key), copies) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        olds = old if isinstance(old, list | tuple) and len(old) == len(obj) else [None] * len(obj)
        items = [_stage(value, prev, copies) for value, prev in zip(obj, olds, strict=True)]
        return items if isinstance(obj, list) else tuple(items)
    if obj is None or isinstance(obj, int | float | complex | str | bytes):
        return obj  # immutable
    if isinstance(obj, io.BytesIO):
        return io.BytesIO(obj.getvalue())
    return copy.deepcopy(obj)


def _stage_tensor(
    tensor: torch.Tensor, old: torch.Tensor | None, copies: list[_Copy]
) -> torch.Tensor:
    src = tensor.detach()
    if (
        old is not None
        and type(old) is torch.Tensor
        and old.device.type == "cpu"
        and old.shape == src.shape
        and old.dtype == src.dtype
        and old.is_contiguous()
    ):
        buf = old
    else:
        pin = src.device.type == "cuda"
        buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
    copies.append((buf, src))
    return buf
