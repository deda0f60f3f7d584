"""A resumable, elastic data position: one global sample cursor, any world size.

The job-wide sample order is a seeded permutation per epoch (:class:`GlobalOrder`),
indexed by a global position: the number of samples the whole job has consumed. Step
``s`` consumes the next ``global_batch`` positions; rank ``r`` of ``W`` takes the
contiguous slice ``[r*B/W, (r+1)*B/W)`` of them. The samples of a step are therefore
the same on every world size (only which rank computes which changes), and the whole
data position is one integer that a checkpoint can carry to another world size.

:class:`ElasticSampler` puts this behind ``torch.utils.data.Sampler`` for map-style
datasets and ``DataLoader``::

    sampler = elastic.ElasticSampler(len(dataset), global_batch=64, seed=0)
    loader = sampler.loader(dataset)             # DataLoader(batch_size=64 // world, ...)
    manager = ckpt.CheckpointManager(root, {..., "sampler": sampler})
    manager.resume()                             # restores the cursor
    batches = iter(loader)                       # starts at the cursor
    for step in ...:
        x, y = next(batches)
        ...
        sampler.advance()                        # one global batch consumed

The cursor moves only by :meth:`ElasticSampler.advance`, once per optimizer step: a
``DataLoader`` reads its sampler ahead (worker prefetch), so what the sampler has
handed out is not what training has consumed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler

from elastic.rng import MicroBatch, plan_micro_batches

SAMPLER_STATE_VERSION = 1


class GlobalOrder:
    """The job-wide sample order: a seeded permutation per epoch, indexed by global position.

    Position ``p`` (0-based count of samples consumed by the whole job) maps to epoch
    ``p // n`` and sample ``perm(seed, epoch)[p % n]``. Pure: no state, any rank, any world size.
    """

    def __init__(self, n_samples: int, seed: int) -> None:
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        self.n_samples = n_samples
        self.seed = seed
        self._cache: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._cache.get(epoch)
        if perm is None:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch, 0x5A3D]))
            perm = rng.permutation(self.n_samples)
            self._cache = {epoch: perm}  # positions only move forward; keep one epoch
        return perm

    def sample_ids(self, start: int, count: int) -> np.ndarray:
        """Sample ids at global positions ``start .. start+count-1``."""
        positions = np.arange(start, start + count)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(positions // self.n_samples):
            mask = positions // self.n_samples == epoch
            out[mask] = self.permutation(int(epoch))[positions[mask] % self.n_samples]
        return out


def samples_digest(ids: np.ndarray | torch.Tensor | list[int]) -> str:
    """Short digest of a sequence of global sample ids (logged per step to compare runs)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.cpu().numpy()
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:16]


class ElasticSampler(Sampler[int]):
    """This rank's sample indices of each global batch, from a global cursor (Stateful).

    ``rank`` and ``world_size`` default to the initialized process group's (else 0 and
    1). ``global_batch`` must be divisible by the world size. Iterating yields this
    rank's indices of the global batches from :attr:`cursor` on, across epochs without
    end (a fresh permutation per epoch), so a ``DataLoader`` with ``batch_size =
    local_batch`` gives one step's local batch per ``next()``.

    ``state_dict()`` is the same on every rank (the cursor is global), which is what
    lets a checkpoint written at one world size resume at another.
    """

    def __init__(
        self,
        dataset_len: int,
        global_batch: int,
        *,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if dataset_len < 1:
            raise ValueError(f"dataset_len must be >= 1, got {dataset_len}")
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if global_batch % world_size:
            raise ValueError(
                f"global_batch={global_batch} is not divisible by world_size={world_size}; "
                f"use a multiple of every world size you run on (e.g. {world_size * 12})"
            )
        self.order = GlobalOrder(dataset_len, seed)
        self.global_batch = global_batch
        self.rank = rank
        self.world_size = world_size
        self.cursor = 0
        """Global samples consumed by the whole job (advanced by :meth:`advance`)."""
        self.consumed_digest = ""
        """Running digest of every global sample id consumed so far, in order (audit trail:
        two runs that agree on it consumed the same stream; equal on every world size)."""

    @property
    def local_batch(self) -> int:
        """Samples of one global batch that this rank computes."""
        return self.global_batch // self.world_size

    @property
    def epoch(self) -> int:
        """Epoch of the next sample (``cursor // dataset_len``)."""
        return self.cursor // self.order.n_samples

    def global_batch_ids(self, cursor: int | None = None) -> np.ndarray:
        """Sample ids of the whole global batch at ``cursor`` (default: the current one)."""
        start = self.cursor if cursor is None else cursor
        return self.order.sample_ids(start, self.global_batch)

    def local_batch_ids(self, cursor: int | None = None) -> np.ndarray:
        """This rank's slice of :meth:`global_batch_ids`."""
        start = (self.cursor if cursor is None else cursor) + self.rank * self.local_batch
        return self.order.sample_ids(start, self.local_batch)

    def micro_batches(self, micro_batch: int) -> list[MicroBatch]:
        """This rank's micro-batches of ``micro_batch`` samples in the current global batch.

        Each one carries its rows of the local batch (``mb.local``) and its place in the
        global batch, and ``mb.rng(seed)`` is the RNG scope for its forward
        (:func:`elastic.sample_rng`): dropout masks then depend on the global sample
        positions only, so a resume on another world size continues with the same masks.
        Keep ``micro_batch`` the same on every world size; raises
        :class:`elastic.MicroBatchSplitError` when it does not divide :attr:`local_batch`.
        """
        return plan_micro_batches(
            self.cursor, self.global_batch, self.world_size, self.rank, micro_batch
        )

    def advance(self, steps: int = 1) -> None:
        """Record that ``steps`` global batches were consumed (call once per optimizer step)."""
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        for _ in range(steps):
            ids = self.global_batch_ids()
            self.consumed_digest = hashlib.sha256(
                self.consumed_digest.encode() + np.asarray(ids, dtype=np.int64).tobytes()
            ).hexdigest()[:32]
            self.cursor += self.global_batch

    def __iter__(self) -> Iterator[int]:
        cursor = self.cursor
        while True:
            yield from (int(i) for i in self.local_batch_ids(cursor))
            cursor += self.global_batch

    def loader(self, dataset: Any, **kwargs: Any) -> DataLoader:
        """A ``DataLoader`` over ``dataset`` giving one local batch per step from this sampler.

        It gets its own seeded ``generator`` unless one is given: without it, each
        ``iter(loader)`` draws a seed from the global RNG, which shifts every later
        random draw (dropout) after a resume.
        """
        kwargs.setdefault("batch_size", self.local_batch)
        kwargs.setdefault("generator", torch.Generator().manual_seed(self.order.seed))
        return DataLoader(dataset, sampler=self, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": SAMPLER_STATE_VERSION,
            "cursor": self.cursor,
            "dataset_len": self.order.n_samples,
            "global_batch": self.global_batch,
            "seed": self.order.seed,
            "consumed_digest": self.consumed_digest,
            "next_batch_digest": samples_digest(self.global_batch_ids()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor; the dataset length, global batch and seed must match."""
        for key, mine in (
            ("dataset_len", self.order.n_samples),
            ("global_batch", self.global_batch),
            ("seed", self.order.seed),
        ):
            if int(state[key]) != mine:
                raise ValueError(
                    f"ElasticSampler: the checkpoint was saved with {key}={state[key]} but this "
                    f"sampler has {key}={mine}; the global sample order would differ. Use the "
                    "same dataset, global batch and seed, or start a new checkpoint root."
                )
        cursor = int(state["cursor"])
        saved_next = state.get("next_batch_digest")
        if saved_next and samples_digest(self.global_batch_ids(cursor)) != saved_next:
            raise ValueError(
                f"ElasticSampler: the checkpoint's data stream continues at cursor {cursor} with "
                f"batch digest {saved_next}, but this sampler's order gives "
                f"{samples_digest(self.global_batch_ids(cursor))} there: samples would be skipped "
                "or repeated. Use the same dataset order (numpy version, seed), or start a new "
                "checkpoint root."
            )
        self.cursor = cursor
        self.consumed_digest = str(state.get("consumed_digest", ""))

    def data_position(self) -> dict[str, Any]:
        """Cursor and digests (what a checkpoint's manifest records for auditing)."""
        return {
            "cursor": self.cursor,
            "consumed_digest": self.consumed_digest,
            "next_batch_digest": samples_digest(self.global_batch_ids()),
        }
