"""What every plug-in does around a framework's training loop, whatever its hooks are called.

A plug-in names the state (:meth:`GuardedSteps.state`), opens the manager and the guard
where the framework has built the model and optimizers (:meth:`GuardedSteps.open`),
resumes, and then calls :meth:`GuardedSteps.before` before each optimizer step (at the end
of the step before: there the state is the one a checkpoint records),
:meth:`GuardedSteps.after` once the step's optimizer and scheduler have stepped,
:meth:`GuardedSteps.finish` when training ends and :meth:`GuardedSteps.close` (also after
an exception). The steps are the framework's global optimizer steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import elastic
from ckpt import CheckpointManager, CheckpointOptions, StorageOptions

__all__ = ["GuardedSteps", "StepsView"]


class GuardedSteps:
    """A :class:`ckpt.CheckpointManager` and an :class:`elastic.RunGuard` driven by hooks.

    The keyword arguments are the plug-ins' (documented on their ``ElasticCheckpoints``):
    ``options`` or its fields as keywords, ``sampler``, ``faults``, ``guard`` (keyword
    arguments of the RunGuard), ``extra_state``, ``storage_options``, ``seed``,
    ``on_event``.
    """

    def __init__(
        self,
        root: str,
        *,
        options: CheckpointOptions | None = None,
        sampler: elastic.ElasticSampler | None = None,
        faults: Iterable[str] | str | None = None,
        guard: dict[str, Any] | None = None,
        extra_state: dict[str, Any] | None = None,
        storage_options: StorageOptions | None = None,
        seed: int = 0,
        on_event: Any = None,
        **option_kwargs: Any,
    ) -> None:
        self.root = root
        self.options = CheckpointOptions.resolve(options, option_kwargs)
        self.sampler = sampler
        self.faults = [faults] if isinstance(faults, str) else list(faults or ())
        self.guard_kwargs = dict(guard or {})
        self.extra_state = dict(extra_state or {})
        self.storage_options = storage_options
        self.seed = seed
        self.on_event = on_event
        self.manager: CheckpointManager | None = None
        """The run's manager, from :meth:`open` to :meth:`close`."""
        self.guard: elastic.RunGuard | None = None
        self.resumed_step: int | None = None
        """The step the run resumed from (None: a fresh start)."""
        self._offered_step = -1
        self._final_offered = False
        self._step_started = 0.0

    def state(self, framework: str, own: dict[str, Any]) -> dict[str, Any]:
        """``own`` (what the framework keeps), the sampler and ``extra_state`` in one dict."""
        state = dict(own)
        if self.sampler is not None:
            state["sampler"] = self.sampler
        clash = sorted(set(state) & set(self.extra_state))
        if clash:
            raise ValueError(f"extra_state names {clash}, which the {framework} state uses")
        state.update(self.extra_state)
        return state

    def open(self, state: dict[str, Any]) -> None:
        """Build the manager (a collective: every rank, same point) and the guard (not yet
        entered: it checks for a repeated error and shields loader workers to come)."""
        self.manager = CheckpointManager(
            self.root,
            state,
            options=self.options,
            seed=self.seed,
            storage_options=self.storage_options,
            on_event=self.on_event,
        )
        self.guard = elastic.RunGuard(
            saver=self.manager, faults=self.faults, on_event=self.on_event, **self.guard_kwargs
        )

    def resume(self) -> int | None:
        """The manager's resume (closing both when it raises); the step, or None."""
        assert self.manager is not None
        try:
            self.resumed_step = self.manager.resume()
        except BaseException as exc:
            self.close(exc)
            raise
        return self.resumed_step

    def start(self, step: int) -> None:
        """Enter the guard (its SIGTERM handler from now on) and run its checks before
        ``step + 1``, the first step this run trains."""
        assert self.guard is not None
        self.guard.__enter__()
        self._offered_step = step
        self.before(step + 1)

    def before(self, step: int) -> None:
        """The guard's hooks before ``step``: its faults, then the preemption agreement
        (an emergency checkpoint of ``step - 1`` and exit 143); closes both when it raises."""
        if self.guard is None:
            return
        try:
            self.guard.before_step(step)
        except BaseException as exc:
            self.close(exc)
            raise
        self._step_started = time.perf_counter()

    def after(self, step: int, *, last_step: int) -> None:
        """``step`` trained (``last_step``: the run's, or <= 0 for none): feed the guard,
        offer the step to the manager (the final one synchronously), then run the guard's
        checks before the next one. A step offered already (an accumulating micro-batch)
        is passed over."""
        if self.manager is None or step == self._offered_step:
            return
        self._offered_step = step
        if self.guard is not None:
            self.guard.after_step(step, time.perf_counter() - self._step_started)
        self._final_offered = last_step > 0 and step >= last_step
        self.manager.maybe_save(step, final=self._final_offered)
        if not self._final_offered:
            self.before(step + 1)

    def finish(self, step: int) -> None:
        """Training ended at ``step`` (by its step limit, its epochs or a stop): the run ends
        on a commit of that step."""
        if self.manager is not None and not self._final_offered and step > 0:
            self._final_offered = True
            self.manager.maybe_save(step, final=True)

    def close(self, failure: BaseException | None) -> None:
        """Close the guard (it closes the manager first: a background save drained, the
        root released; an error a restart repeats is noted) and the manager; idempotent."""
        guard, manager = self.guard, self.manager
        self.guard = self.manager = None
        if guard is not None:
            guard.__exit__(type(failure) if failure else None, failure, None)
        if manager is not None:
            manager.close()


class StepsView:
    """A plug-in callback's :class:`GuardedSteps` (``self.steps``), built from the
    callback's arguments (those of :class:`GuardedSteps`, documented on each callback),
    and what the callback shows of it."""

    def __init__(self, root: str, **settings: Any) -> None:
        self.steps = GuardedSteps(root, **settings)

    @property
    def manager(self) -> CheckpointManager | None:
        """The run's manager while training runs (None before and after)."""
        return self.steps.manager

    @property
    def resumed_step(self) -> int | None:
        """The global step the run resumed from (None: a fresh start)."""
        return self.steps.resumed_step
