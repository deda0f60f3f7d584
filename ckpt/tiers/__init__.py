"""The tier interface: where a manager saves and what a resume can load from.

A :class:`~ckpt.manager.CheckpointManager` holds an ordered list of :class:`Tier`
objects (the default: the memory tier when ``memory_every`` is on, then the durable
root) and knows none of them by name. Each tier has both halves:

- save: its :class:`~ckpt.saving.policy.SaveDecisionPolicy` says whether a step is due,
  :meth:`Tier.save` saves it. ``maybe_save`` offers a step to every tier in order,
  with one :class:`SaveRequest` that captures the state once for all of them.
- load: :meth:`CheckpointManager.resume <ckpt.manager.CheckpointManager.resume>` walks
  the tiers in order (:mod:`ckpt.tiers.resume`) and, per tier, its candidates newest first.
  A tier says which candidates it has and loads one into a state template with the
  normal verified load (``ckpt.loading.restore.load``); the walk does everything else once, for
  every tier: the shape check, fresh optimizers, the RNG decision, per-rank layout,
  pushing the state into the objects, events and logs. ``strict`` tiers (durable)
  raise on a candidate that does not fit; others note why and let the next candidate,
  then the next tier, try. :meth:`Tier.resumed` / :meth:`Tier.exhausted` end a tier's
  part (the memory tier prunes the snapshots it will not need).
- :meth:`Tier.close`, last tier first, each told the newest durable commit (the memory
  tier drops its snapshots when the durable tier has caught up).

Tiers are built by :data:`TierBuilder` functions from a :class:`TierContext` (the
manager's options, its durable save engine and its event callback); the default list is
:data:`ckpt.tiers.defaults.DEFAULT_TIERS`. Exactly one tier is ``strict``: the durable
root, the commit of record (retention, the failure stop, emergency saves).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckpt.loading.restore import LoadResult
from ckpt.options import CheckpointOptions
from ckpt.root.catalog import Catalog
from ckpt.saving.policy import SaveDecisionPolicy
from ckpt.saving.saves import DurableSaves
from ckpt.state.capture import MANAGER_META_KEY, Captured, StateCapture

Emit = Callable[..., None]
"""``emit(name, step, **fields)``: the manager's event callback."""


@dataclass(frozen=True, slots=True)
class DurableHead:
    """The newest committed durable checkpoint, as the coordinator listed it."""

    step: int
    world_size: int
    record: dict[str, Any]
    run_id: str
    restart_count: int


@dataclass(slots=True)
class Candidate:
    """One checkpoint a tier could resume from."""

    step: int
    world_size: int
    record: dict[str, Any]
    """The manager's record in its manifest (keys, shapes, fresh optimizers, RNG, per-rank)."""
    handle: Any = None
    """The tier's own reference (a memory-tier survey candidate)."""
    url: str = ""
    """Where it is, for events about it (a ``fallback`` that rejected it)."""


@dataclass(slots=True)
class ResumeScope:
    """What one resume shares with every tier (every rank; ``catalog`` read on the coordinator)."""

    catalog: Catalog
    """The one listing of the durable root this resume made."""
    head: DurableHead | None
    """The newest committed durable checkpoint (None: none, or not this job's)."""
    notes: list[str] = field(default_factory=list)
    """Why candidates were passed over: said in the ``tier_choice`` event."""


class SaveRequest:
    """One step offered to the tiers (every rank alike): the state is captured once, by the
    first tier that asks, and the later tiers of the same step save that capture."""

    def __init__(
        self,
        step: int,
        capture: StateCapture,
        *,
        final: bool = False,
        emergency: bool = False,
        blocking: bool | None = None,
    ) -> None:
        self.step = step
        self.final = final
        """The run's last step (``maybe_save(final=True)``)."""
        self.emergency = emergency
        """After a termination signal (``emergency_save``): synchronous, no failure stop."""
        self.blocking = blocking
        """None: the tier decides (the durable tier: synchronous at ``final`` or without
        ``async_save``)."""
        self._capture = capture
        self.taken: Captured | None = None
        """The capture of this step, once a tier asked for it."""

    def capture(self, *, reuse_shapes: bool = False) -> Captured:
        """The state dict, manifest metadata and fresh optimizers of this step (captured once)."""
        if self.taken is None:
            self.taken = self._capture.capture(self.step, reuse_shapes=reuse_shapes)
        return self.taken


@dataclass(frozen=True, slots=True)
class TierContext:
    """What a :data:`TierBuilder` gets from the manager (built on every rank, in order)."""

    options: CheckpointOptions
    saves: DurableSaves
    """The durable save engine: the root, the manager's checkpoint group (None: one
    process), rank, storage options and event sink; the durable tier saves with it, and
    every tier's saves and loads run in its ``saves.session``
    (:class:`~ckpt.saving.session.Session`)."""
    emit: Emit


class Tier(Protocol):
    """A place a manager saves to and resumes from (see the module docstring)."""

    name: str
    strict: bool
    policy: SaveDecisionPolicy
    timings: dict[str, float]
    """Seconds of the last resume's parts (``tier_choice`` event); may stay empty."""

    def save(self, request: SaveRequest) -> str | None:
        """Save ``request.step`` (collective); its URL, or None (nothing, or failed)."""
        ...

    def candidates(self, scope: ResumeScope) -> list[Candidate]: ...

    def load(
        self, cand: Candidate, template: dict[str, Any], want_rng: bool, scope: ResumeScope
    ) -> tuple[LoadResult | None, bool]:
        """Load ``cand`` into ``template``: (result or None if it vanished, RNG loaded)."""
        ...

    def url(self, result: LoadResult) -> str: ...

    def resumed(self, cand: Candidate) -> None: ...

    def exhausted(self) -> None: ...

    def close(self, durable_step: int | None, timeout: float | None) -> None:
        """Finish and release (every rank); ``durable_step``: the newest durable commit."""
        ...


TierBuilder = Callable[[TierContext], "Tier | None"]
"""Builds one tier for a manager (collective), or None when the options leave it off."""


def manager_record(metadata: dict[str, Any]) -> dict[str, Any]:
    record = metadata.get(MANAGER_META_KEY, {})
    return record if isinstance(record, dict) else {}


def build_tiers(builders: Sequence[TierBuilder], context: TierContext) -> list[Tier]:
    """The tiers ``builders`` give (every rank, in order: a builder may be collective);
    each with its own name, exactly one strict (the durable root), and it last."""
    tiers = [tier for build in builders if (tier := build(context)) is not None]
    names = [tier.name for tier in tiers]
    strict = [tier.name for tier in tiers if tier.strict]
    if len(set(names)) != len(names):
        raise ValueError(f"tiers: each tier needs its own name, got {names}")
    if len(strict) != 1 or not tiers[-1].strict:
        raise ValueError(
            f"tiers: exactly one strict tier (the durable root), and last, got {names} "
            f"with strict {strict}"
        )
    return tiers
