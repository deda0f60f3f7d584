"""The memory tier: snapshots every K steps in node-local memory, replicated to a peer.

Modules: :mod:`~ckpt.memory.tier` (:class:`MemoryTier`: taking a snapshot),
:mod:`~ckpt.memory.layout` (the on-node directory layout), :mod:`~ckpt.memory.shard`
(a rank's shard in DCP format), :mod:`~ckpt.memory.replicate` (the background copy to
peers), :mod:`~ckpt.memory.restore` (survey, assemble, prune at resume),
:mod:`~ckpt.memory.fs` (the ``ckptmem://`` filesystem a resume loads from) and
:mod:`~ckpt.memory.snapshots` (:class:`MemorySnapshots`, the tier as a
:class:`ckpt.tiers.Tier`: when to snapshot, resume, close; ``build_memory_tier``). See
docs/design.md, "Memory tier".
"""

from ckpt.memory.snapshots import MemorySnapshots
from ckpt.memory.tier import MemoryTier, SnapshotError

__all__ = ["MemorySnapshots", "MemoryTier", "SnapshotError"]
