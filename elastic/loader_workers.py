"""DataLoader worker processes that outlive a SIGTERM meant for their parent.

A preemption reaches a training process through its process group: torchrun's agent,
on SIGTERM, signals each worker's group (``os.killpg``), and so does a node drain that
signals every group. ``DataLoader`` worker processes are in their parent's group and
die of it: torch's handler in the worker (``_set_worker_signal_handlers``,
torch/csrc/DataLoader.cpp) exits quietly only for a SIGTERM its parent sent and
re-raises any other, and the parent's SIGCHLD handler then raises "DataLoader worker
(pid N) is killed by signal: Terminated" wherever the main thread is, mid-step
included, before ``elastic.RunGuard`` reaches the step boundary where it commits the
emergency checkpoint. The parent is the one to decide what a SIGTERM means; its
loader workers follow it.

:func:`shield_loader_workers` (called by :func:`elastic.init_distributed` and by
``RunGuard``; once per process) changes two places of ``torch.utils.data`` for every
``DataLoader`` the process iterates from then on, its own or the user's, whatever the
worker start method:

- the worker processes are started with SIGTERM blocked in the starting thread
  (``_MultiProcessingDataLoaderIter.__init__``), so a child is never without the block,
  neither between ``fork`` and its first line nor while a ``spawn`` child imports;
- each worker runs :class:`ShieldedWorkerLoop` (in place of torch's ``_worker_loop``,
  which it calls): SIGTERM stays blocked and a thread takes it with ``sigwaitinfo``.
  From the parent (``DataLoader``'s own ``terminate()`` of a worker that did not stop
  when asked) it exits at once, as torch's handler does; from anyone else it does not,
  and from then on the worker leaves within :data:`FOLLOW_POLL_S` of its parent's
  exit, instead of torch's own check every 5 s (``MP_STATUS_CHECK_INTERVAL``).

So the parent, signalled too, finishes its step, commits the emergency checkpoint and
exits 143 while its workers keep serving it; the ``DataLoader`` shuts them down as
always when the parent lets go of its iterator. A worker started before the call (an
iterator created before ``init_distributed`` or the guard) keeps torch's behaviour.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from elastic.sample_seeds import note_loader

SHIELDED = signal.SIGTERM
"""The signal loader workers take from their parent only."""
FOLLOW_POLL_S = 0.05
"""After a SIGTERM from elsewhere, how often a worker checks that its parent still runs."""

_LOCK = threading.Lock()


def shield_loader_workers() -> bool:
    """Make ``DataLoader`` workers started from now on survive a SIGTERM that is not
    their parent's and leave with their parent (see the module docstring); idempotent.

    Returns False (and changes nothing) when this torch does not have the two places
    it replaces: the loader then keeps torch's behaviour.
    """
    from torch.utils.data import dataloader
    from torch.utils.data._utils import worker

    iterator = getattr(dataloader, "_MultiProcessingDataLoaderIter", None)
    loop = getattr(worker, "_worker_loop", None)
    if iterator is None or loop is None:
        return False
    with _LOCK:
        if isinstance(loop, ShieldedWorkerLoop):
            return True  # done before in this process (or in the one it was forked from)
        iterator.__init__ = _starting_blocked(iterator.__init__)
        worker._worker_loop = ShieldedWorkerLoop(loop)
    return True


def shielded() -> bool:
    """Whether :func:`shield_loader_workers` ran in this process (or its forked parent)."""
    from torch.utils.data._utils import worker

    return isinstance(getattr(worker, "_worker_loop", None), ShieldedWorkerLoop)


@contextlib.contextmanager
def _blocked(signum: int) -> Iterator[None]:
    """``signum`` blocked in this thread while the block runs (a signal arriving then is
    taken by another thread, or when the block ends: never lost)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signum})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _starting_blocked(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
        context = loader.multiprocessing_context
        if context is None:
            import torch.multiprocessing as context
        if context.get_start_method() != "fork":
            # multiprocessing unblocks SIGTERM in the calling thread after it first starts
            # its resource tracker, which a spawn start does: start it before the block.
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
        note_loader(loader)  # workers over a sampler with an unseeded dataset: said at save
        with _blocked(SHIELDED):
            init(self, loader, *args, **kwargs)

    return __init__


@dataclasses.dataclass(frozen=True, slots=True)
class ShieldedWorkerLoop:
    """torch's ``_worker_loop`` behind the shield: the ``target`` of every loader worker.

    In the worker it takes SIGTERM on a thread of its own, then runs torch's loop. A
    ``spawn`` start pickles it: it is rebuilt in the child around that interpreter's own
    ``_worker_loop`` (:func:`_rebuilt`), which nothing there replaced.
    """

    loop: Callable[..., None]

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        parent = os.getppid()
        signal.pthread_sigmask(signal.SIG_BLOCK, {SHIELDED})  # before any thread starts
        threading.Thread(
            target=_follow_parent, args=(parent,), name="loader-worker-sigterm", daemon=True
        ).start()
        self.loop(*args, **kwargs)

    def __reduce__(self) -> tuple[Callable[[], ShieldedWorkerLoop], tuple[()]]:
        return _rebuilt, ()


def _rebuilt() -> ShieldedWorkerLoop:
    from torch.utils.data._utils import worker

    loop = worker._worker_loop
    return loop if isinstance(loop, ShieldedWorkerLoop) else ShieldedWorkerLoop(loop)


def _follow_parent(parent: int) -> None:
    """Exit on the parent's SIGTERM; after anyone else's, exit once the parent is gone."""
    foreign = False
    while True:
        if foreign:
            info = signal.sigtimedwait({SHIELDED}, FOLLOW_POLL_S)
        else:
            info = signal.sigwaitinfo({SHIELDED})
        if info is not None and info.si_pid == parent:
            os._exit(0)  # what torch's own handler does for its parent's SIGTERM
        foreign = foreign or info is not None
        if foreign and os.getppid() != parent:
            os._exit(0)
