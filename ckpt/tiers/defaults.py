"""The tiers a :class:`~ckpt.manager.CheckpointManager` builds when it is given none.

In order: the memory tier (built only when ``options.memory_every`` is on), then the
durable root. The manager knows no tier by name: a new tier is a module with a
:data:`~ckpt.tiers.TierBuilder` and a place in this list (or in the ``tiers=`` a caller
passes to the manager).
"""

from __future__ import annotations

from ckpt.tiers import TierBuilder
from ckpt.tiers.durable import build_durable_tier
from ckpt.tiers.memory.snapshots import build_memory_tier

DEFAULT_TIERS: tuple[TierBuilder, ...] = (build_memory_tier, build_durable_tier)
"""Memory first (a resume prefers a newer snapshot), then durable."""
