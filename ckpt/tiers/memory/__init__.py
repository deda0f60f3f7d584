"""The memory tier: snapshots every K steps in node-local memory, replicated to a peer.

Modules: :mod:`~ckpt.tiers.memory.tier` (:class:`MemoryTier`: taking a snapshot),
:mod:`~ckpt.tiers.memory.layout` (the on-node directory layout), :mod:`~ckpt.tiers.memory.shard`
(a rank's shard in DCP format), :mod:`~ckpt.tiers.memory.replicate` (the background copy to
peers), :mod:`~ckpt.tiers.memory.restore` (survey, assemble, prune at resume),
:mod:`~ckpt.tiers.memory.fs` (the ``ckptmem://`` filesystem a resume loads from) and
:mod:`~ckpt.tiers.memory.snapshots` (:class:`MemorySnapshots`, the tier as a
:class:`ckpt.tiers.Tier`: when to snapshot, resume, close; ``build_memory_tier``). See
docs/design.md, "Memory tier".
"""

from ckpt.tiers.memory.snapshots import MemorySnapshots
from ckpt.tiers.memory.tier import MemoryTier, SnapshotError

__all__ = ["MemorySnapshots", "MemoryTier", "SnapshotError"]
