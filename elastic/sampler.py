"""A resumable, elastic data position: one global sample cursor, any world size.

The job-wide sample order is a seeded permutation per epoch (:class:`GlobalOrder`),
indexed by a global position: the number of samples the whole job has consumed. Rank
``r`` of ``W`` takes the contiguous slice ``[r*k/W, (r+1)*k/W)`` of each global batch
of ``k`` samples. The samples of a step are therefore the same on every world size
(only which rank computes which changes), and the whole data position is one integer
that a checkpoint can carry to another world size.

:class:`ElasticSampler` puts this behind ``torch.utils.data`` for map-style datasets,
in the two shapes training loops come in.

A step loop (``sampler.loader()``, endless: epochs follow each other inside the
stream, and a global batch may hold the end of one epoch and the start of the next)::

    sampler = elastic.ElasticSampler(len(dataset), global_batch=64, seed=0)
    batches = iter(sampler.loader(dataset))      # DataLoader(batch_size=64 // world, ...)
    manager = ckpt.CheckpointManager(root, {..., "sampler": sampler})
    start = manager.resume() or 0                # restores the cursor
    for step in range(start + 1, max_steps + 1):
        x, y = next(batches)
        ...
        sampler.advance()                        # one global batch consumed

The cursor moves only by :meth:`ElasticSampler.advance`, once per optimizer step: a
``DataLoader`` reads its sampler ahead (worker prefetch), so what the sampler has
handed out is not what training has consumed.

An epoch loop (``sampler.epoch_loader()``: one epoch per ``for``, with ``len()``)::

    loader = sampler.epoch_loader(dataset, collate_fn=collate, num_workers=1)
    steps = epochs * len(loader)                 # batches per epoch, as with a DataLoader
    start = manager.resume() or 0
    for epoch in range(sampler.epoch, epochs):   # a resume continues in its epoch...
        sampler.set_epoch(epoch)                 # (checked against the cursor)
        for batch in loader:                     # ...at the right batch
            ...

Epoch batches never cross an epoch: an epoch of ``n`` samples is ``n // B`` global
batches plus, unless ``drop_last``, one last batch of the ``n % B`` samples left (split
over the ranks as evenly as it goes; dropped with a WARNING if it has fewer samples
than ranks). The epoch loader moves the cursor itself, as it hands each batch to the
loop body (after the ``DataLoader``'s prefetch), so a save in the body records the batch
the body trains on as consumed, and the loop calls no ``advance()``.

A checkpoint written with one global batch continues with another only on request
(``allow_batch_change=True``): from the same sample cursor, said at WARNING and
recorded (``batch_change`` event of the checkpoint manager's resume).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler

from elastic.errors import SamplerStateError
from elastic.rng import (
    MicroBatch,
    derive_seed,
    plan_micro_batches,
    plan_micro_batches_at,
    rank_slice,
)
from elastic.sample_seeds import SampleKey, SeededDataset
from runcore import positions

logger = logging.getLogger(__name__)

SAMPLER_STATE_VERSION = 1
STEPS = "steps"
"""Batch mode of :meth:`ElasticSampler.loader` (endless, batches may span epochs)."""
EPOCHS = "epochs"
"""Batch mode of :meth:`ElasticSampler.epoch_loader` (one epoch per iteration)."""
_LOADER_OWNED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")
"""DataLoader arguments the epoch loader sets itself."""


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


def epoch_batches(
    cursor: int, n_samples: int, global_batch: int, world_size: int, drop_last: bool
) -> list[tuple[int, int]]:
    """``(start, size)`` of every epoch batch from ``cursor`` to the end of its epoch. Pure.

    Full batches of ``global_batch``, then the rest of the epoch unless ``drop_last`` or
    fewer than ``world_size`` samples are left (a rank would get none).
    """
    end = (cursor // n_samples + 1) * n_samples
    out = []
    at = cursor
    while end - at >= global_batch:
        out.append((at, global_batch))
        at += global_batch
    if at < end and not drop_last and end - at >= world_size:
        out.append((at, end - at))
    return out


def batch_size_suggestion(global_batch: int, world_size: int) -> str:
    """The multiples of ``world_size`` nearest ``global_batch``, for an error message."""
    below = global_batch - global_batch % world_size
    above = below + world_size
    return f"{below} or {above}" if below > 0 else str(above)


class ElasticSampler(Sampler[int]):
    """This rank's sample indices of each global batch, from a global cursor (Stateful).

    ``rank`` and ``world_size`` default to the initialized process group's (else 0 and
    1). ``global_batch`` must be divisible by the world size. Iterating yields this
    rank's indices of the global batches from :attr:`cursor` on, across epochs without
    end (a fresh permutation per epoch), so a ``DataLoader`` with ``batch_size =
    local_batch`` gives one step's local batch per ``next()`` (:meth:`loader`);
    :meth:`epoch_loader` gives one epoch per iteration instead.

    ``allow_batch_change``: resuming a checkpoint written with another global batch
    continues from its sample cursor with this one (said at WARNING, recorded as
    :attr:`batch_change`), instead of refusing it.

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
        allow_batch_change: bool = False,
    ) -> None:
        if dataset_len < 1:
            raise ValueError(f"dataset_len must be >= 1, got {dataset_len}")
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        self.order = GlobalOrder(dataset_len, seed)
        self.global_batch = global_batch
        self.rank = 0
        self.world_size = 1
        self.bind(rank, world_size)
        self.allow_batch_change = allow_batch_change
        self.cursor = 0
        """Global samples consumed by the whole job (advanced by :meth:`advance`, or by
        the epoch loader as it hands out batches)."""
        self.consumed_digest = ""
        """Running digest of every global sample id consumed so far, in order (audit trail:
        two runs that agree on it consumed the same stream; equal on every world size)."""
        self.batch_change: dict[str, int] | None = None
        """After a resume that changed the global batch: ``{"cursor", "old_global_batch",
        "new_global_batch"}`` (the checkpoint manager reports it as an event)."""
        self.mode: str | None = None
        """``"steps"`` once :meth:`loader` was called, ``"epochs"`` after :meth:`epoch_loader`."""
        self.drop_last = False
        """Epoch loader: drop each epoch's last global batch when it is short."""
        self._current: tuple[int, int] | None = None
        """Epoch loader: (start, size) of the batch handed to the loop body last."""
        self._warned_short: set[int] = set()
        self._keyed = False
        """Hand out :class:`~elastic.sample_seeds.SampleKey` indices (a seeded dataset
        reads their positions): set by :meth:`seeded`."""
        self._unseeded_workers = 0
        self._said_unseeded = False
        positions.register(self)

    def bind(self, rank: int, world_size: int) -> None:
        """Set this rank's place in the job (checked as at construction).

        For a sampler built before the process group existed (a framework's trainer
        starts it inside ``fit``), so it took rank 0 of 1: the plug-ins of
        :mod:`integrations` bind it to the trainer's rank and world size before the first
        batch. The cursor, and so the data position, does not change.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if self.global_batch % world_size:
            raise ValueError(
                f"global_batch={self.global_batch} is not divisible by world_size={world_size}; "
                f"use a multiple of it (e.g. "
                f"{batch_size_suggestion(self.global_batch, world_size)}), "
                "or of every world size you run on"
            )
        self.rank = rank
        self.world_size = world_size

    @property
    def local_batch(self) -> int:
        """Samples of one (full) global batch that this rank computes."""
        return self.global_batch // self.world_size

    @property
    def epoch(self) -> int:
        """Epoch of the next sample (``cursor // dataset_len``)."""
        return self.cursor // self.order.n_samples

    # -- batches -----------------------------------------------------------------------

    def _batch_at(self, cursor: int | None) -> tuple[int, int]:
        """(start, size) of the batch a loop body trains on now, or of the one at ``cursor``."""
        if self.mode != EPOCHS:
            return (self.cursor if cursor is None else cursor), self.global_batch
        if cursor is None and self._current is not None:
            return self._current
        planned = self._epoch_plan(self.cursor if cursor is None else cursor)
        if planned:
            return planned[0]
        # The cursor's epoch has no batch left: the next one starts the next epoch.
        return self._epoch_plan(self._epoch_end(self.cursor if cursor is None else cursor))[0]

    def global_batch_ids(self, cursor: int | None = None) -> np.ndarray:
        """Sample ids of the whole global batch the loop body trains on now.

        Step loader: the batch at the cursor (before :meth:`advance`). Epoch loader: the
        batch it handed out last. With ``cursor``: the batch starting there.
        """
        start, size = self._batch_at(cursor)
        return self.order.sample_ids(start, size)

    def local_batch_ids(self, cursor: int | None = None) -> np.ndarray:
        """This rank's slice of :meth:`global_batch_ids`."""
        start, size = self._batch_at(cursor)
        lo, hi = rank_slice(size, self.world_size, self.rank)
        return self.order.sample_ids(start + lo, hi - lo)

    def micro_batches(self, micro_batch: int) -> list[MicroBatch]:
        """This rank's micro-batches of ``micro_batch`` samples in the current global batch.

        Each one carries its rows of the local batch (``mb.local``) and its place in the
        global batch, and ``mb.rng(seed)`` is the RNG scope for its forward
        (:func:`elastic.sample_rng`): dropout masks then depend on the global sample
        positions only, so a resume on another world size continues with the same masks.
        Keep ``micro_batch`` the same on every world size; raises
        :class:`elastic.MicroBatchSplitError` when it does not divide :attr:`local_batch`.
        A batch off the regular grid (after a global batch change; any epoch-loader
        batch) is cut into pieces of ``micro_batch`` keyed by their first sample position
        (:func:`elastic.rng.plan_micro_batches_at`).
        """
        start, size = self._batch_at(None)
        if self.mode != EPOCHS and start % self.global_batch == 0:
            return plan_micro_batches(
                start, self.global_batch, self.world_size, self.rank, micro_batch
            )
        return plan_micro_batches_at(start, size, self.world_size, self.rank, micro_batch)

    def advance(self, steps: int = 1) -> None:
        """Record that ``steps`` global batches were consumed (call once per optimizer step)."""
        if self.mode == EPOCHS:
            raise SamplerStateError(
                "ElasticSampler.advance(): this sampler's epoch_loader() moves the cursor "
                "itself as it hands out each batch; remove the advance() call (it would skip "
                "a batch per step)"
            )
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        for _ in range(steps):
            self._consume(self.cursor, self.global_batch)

    def _consume(self, start: int, size: int) -> None:
        ids = self.order.sample_ids(start, size)
        self.consumed_digest = hashlib.sha256(
            self.consumed_digest.encode() + np.asarray(ids, dtype=np.int64).tobytes()
        ).hexdigest()[:32]
        self.cursor = start + size

    def _indices(self, start: int, count: int) -> list[int]:
        """The dataset indices at global positions ``[start, start + count)``: keyed
        with their positions once :meth:`seeded` was called, plain ints otherwise."""
        ids = self.order.sample_ids(start, count)
        if self._keyed:
            return [SampleKey(int(i), start + j) for j, i in enumerate(ids)]
        return [int(i) for i in ids]

    def __iter__(self) -> Iterator[int]:
        cursor = self.cursor
        while True:
            start, size = self._batch_at(cursor)
            lo, hi = rank_slice(size, self.world_size, self.rank)
            yield from self._indices(start + lo, hi - lo)
            cursor += self.global_batch

    def seeded(self, dataset: Any) -> SeededDataset:
        """``dataset``, its ``__getitem__`` drawing random numbers (``torch``, ``random``,
        ``numpy``) from streams seeded by each sample's global position, so augmentation
        resumes exactly on any worker count and world size (:mod:`elastic.sample_seeds`).
        From now on this sampler hands out :class:`~elastic.sample_seeds.SampleKey`
        indices. :meth:`loader` and :meth:`epoch_loader` call it; for a ``DataLoader`` of
        your own: ``DataLoader(sampler.seeded(dataset), sampler=sampler, ...)``."""
        self._keyed = True
        if isinstance(dataset, SeededDataset):
            return dataset
        return SeededDataset(dataset, self.order.seed)

    def note_unseeded_workers(self, workers: int) -> None:
        """A ``DataLoader`` with ``workers`` worker processes iterates this sampler over a
        dataset that is not :meth:`seeded`: said at WARNING at the first save."""
        self._unseeded_workers = max(self._unseeded_workers, int(workers))

    def __bool__(self) -> bool:
        return True  # not len(): a step loader has none

    def __len__(self) -> int:
        raise TypeError(
            "ElasticSampler has no len(): its step loader never ends (epochs follow each "
            "other). For an epoch loop with len(loader) use sampler.epoch_loader(dataset)"
        )

    def loader(self, dataset: Any, *, seed_samples: bool = True, **kwargs: Any) -> DataLoader:
        """An endless ``DataLoader`` over ``dataset``: one local batch per ``next()``.

        For step loops: call :meth:`advance` once per optimizer step. It gets its own
        seeded ``generator`` unless one is given: without it, each ``iter(loader)``
        draws a seed from the global RNG, which shifts every later random draw
        (dropout) after a resume. ``seed_samples`` (default True): random numbers drawn
        in ``dataset.__getitem__`` depend on each sample's position only (:meth:`seeded`).
        """
        self._set_mode(STEPS)
        kwargs.setdefault("batch_size", self.local_batch)
        kwargs.setdefault("generator", torch.Generator().manual_seed(self.order.seed))
        if seed_samples:
            dataset = self.seeded(dataset)
        return DataLoader(dataset, sampler=self, **kwargs)

    # -- epochs ------------------------------------------------------------------------

    def epoch_loader(
        self, dataset: Any, *, drop_last: bool = False, seed_samples: bool = True, **kwargs: Any
    ) -> EpochLoader:
        """A loader giving one epoch per iteration, from the cursor (see the module docstring).

        ``len(loader)`` is the number of global batches of an epoch; ``for batch in
        loader`` yields this rank's part of each batch left in the cursor's epoch, so
        the first iteration after a resume finishes the epoch the checkpoint was in.
        ``drop_last``: drop each epoch's last global batch when it has fewer than
        ``global_batch`` samples (default False: keep it, shorter). ``seed_samples``
        (default True): random numbers drawn in ``dataset.__getitem__`` depend on each
        sample's position only (:meth:`seeded`). Other keyword
        arguments go to the ``DataLoader`` (``collate_fn``, ``num_workers``, ...); the
        batches are the sampler's, so ``batch_size``, ``shuffle``, ``sampler`` and
        ``batch_sampler`` are refused. Do not call :meth:`advance`: the loader moves
        the cursor as it hands each batch to the loop body.
        """
        given = sorted(set(kwargs) & set(_LOADER_OWNED))
        if given:
            raise TypeError(
                f"epoch_loader() sets {', '.join(given)} itself: each rank's batch is its "
                f"share of global_batch={self.global_batch} (drop_last is this method's own "
                "argument); remove them"
            )
        self._set_mode(EPOCHS)
        self.drop_last = bool(drop_last)
        if self.drop_last and self.order.n_samples < self.global_batch:
            raise ValueError(
                f"epoch_loader(drop_last=True): the dataset has {self.order.n_samples} samples, "
                f"fewer than global_batch={self.global_batch}, so every epoch would be empty"
            )
        if self.order.n_samples < self.world_size:
            raise ValueError(
                f"epoch_loader(): {self.order.n_samples} samples cannot give each of "
                f"{self.world_size} ranks one"
            )
        return EpochLoader(self, self.seeded(dataset) if seed_samples else dataset, kwargs)

    def batches_per_epoch(self) -> int:
        """Global batches of a whole epoch with the epoch loader (its ``len()``)."""
        return len(self._epoch_plan(0))

    def set_epoch(self, epoch: int) -> None:
        """Accept the epoch an epoch loop is about to run, if it is the cursor's.

        As ``DistributedSampler.set_epoch``, but the order is already a function of the
        epoch: this checks that ``epoch`` is the epoch the cursor is in (a loop that
        restarts from epoch 0 after a resume would train past its last epoch) and
        raises :class:`elastic.errors.SamplerStateError` otherwise. Iterate ``for epoch
        in range(sampler.epoch, epochs)``.
        """
        if self.mode == EPOCHS:
            self._skip_exhausted_epoch()
        if int(epoch) != self.epoch:
            where = f"sample {self.cursor % self.order.n_samples} of {self.order.n_samples}"
            raise SamplerStateError(
                f"ElasticSampler.set_epoch({epoch}): the data cursor ({self.cursor}) is in "
                f"epoch {self.epoch} ({where} is next); after a resume the loop continues "
                "there: iterate `for epoch in range(sampler.epoch, epochs)`"
            )

    def _set_mode(self, mode: str) -> None:
        if self.mode is not None and self.mode != mode:
            raise SamplerStateError(
                f"this ElasticSampler already feeds a {self.mode} loader; a sampler drives one "
                "loop: use loader() for a step loop or epoch_loader() for an epoch loop, not both"
            )
        self.mode = mode

    def _epoch_end(self, cursor: int) -> int:
        return (cursor // self.order.n_samples + 1) * self.order.n_samples

    def _epoch_plan(self, cursor: int) -> list[tuple[int, int]]:
        return epoch_batches(
            cursor, self.order.n_samples, self.global_batch, self.world_size, self.drop_last
        )

    def _skip_exhausted_epoch(self) -> None:
        """Move a cursor whose epoch has no batch left (a short tail) to the next epoch."""
        if self.cursor % self.order.n_samples and not self._epoch_plan(self.cursor):
            self._say_short_tail(self.cursor)
            self.cursor = self._epoch_end(self.cursor)

    def _say_short_tail(self, at: int) -> None:
        """Say once per epoch that its tail is dropped because it is short of the ranks."""
        left = self._epoch_end(at) - at
        epoch = at // self.order.n_samples
        if self.drop_last or epoch in self._warned_short or self.rank != 0:
            return
        self._warned_short.add(epoch)
        logger.warning(
            "rank 0: epoch %d: its last %d sample(s) are dropped: fewer than the %d ranks, "
            "so a rank would get none (a dataset length that leaves at least one sample per "
            "rank in the last batch keeps them)",
            epoch, left, self.world_size,
        )  # fmt: skip

    def _plan_epoch_iteration(self) -> list[tuple[int, int]]:
        """The batches the next ``for batch in loader`` yields: the rest of the cursor's epoch."""
        self._skip_exhausted_epoch()
        plan = self._epoch_plan(self.cursor)
        last_start, last_size = plan[-1] if plan else (self.cursor, 0)
        if last_start + last_size < self._epoch_end(self.cursor):
            self._say_short_tail(last_start + last_size)
        return plan

    def _hand_out(self, start: int, size: int) -> None:
        """The epoch loader gave the batch at ``start`` to the loop body: it is consumed."""
        if start != self.cursor:
            raise SamplerStateError(
                f"ElasticSampler: the epoch loader's batch at {start} is not at the cursor "
                f"{self.cursor}: something else moved the cursor while an epoch was iterated "
                "(advance(), load_state_dict()); start the iteration again"
            )
        self._consume(start, size)
        self._current = (start, size)
        if not self._epoch_plan(self.cursor):
            self.cursor = self._epoch_end(start)  # a dropped tail is not consumed

    # -- state -------------------------------------------------------------------------

    def _order_digest(self, cursor: int, count: int) -> str:
        return samples_digest(self.order.sample_ids(cursor, count))

    def state_dict(self) -> dict[str, Any]:
        self._say_unseeded()
        return {
            "version": SAMPLER_STATE_VERSION,
            "cursor": self.cursor,
            "dataset_len": self.order.n_samples,
            "global_batch": self.global_batch,
            "seed": self.order.seed,
            "consumed_digest": self.consumed_digest,
            "next_batch_digest": self._order_digest(self.cursor, self.global_batch),
            "mode": self.mode or "",
            "drop_last": self.drop_last,
        }

    def _say_unseeded(self) -> None:
        """At the first save after a DataLoader with workers iterated this sampler over a
        dataset that is not seeded per sample: what a resume cannot replay."""
        if not self._unseeded_workers or self._said_unseeded:
            return
        self._said_unseeded = True
        if self.rank == 0:
            logger.warning(
                "rank 0: a DataLoader with %d worker(s) takes its indices from this "
                "ElasticSampler, but random numbers its Dataset draws (augmentation: "
                "torch.rand, random, numpy) come from per-worker streams that a resume "
                "cannot replay: resumed batches will differ from an uninterrupted run's. "
                "Seed them per sample: DataLoader(sampler.seeded(dataset), sampler=sampler, "
                "...)",
                self._unseeded_workers,
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor; the dataset length and seed must match, and the global
        batch too unless ``allow_batch_change``."""
        for key, mine in (("dataset_len", self.order.n_samples), ("seed", self.order.seed)):
            if int(state[key]) != mine:
                raise SamplerStateError(
                    f"ElasticSampler: the checkpoint was saved with {key}={state[key]} but this "
                    f"sampler has {key}={mine}; the global sample order would differ. Use the "
                    "same dataset and seed, or start a new checkpoint root."
                )
        saved_batch = int(state["global_batch"])
        if saved_batch != self.global_batch and not self.allow_batch_change:
            raise SamplerStateError(
                f"ElasticSampler: the checkpoint was saved with global_batch={saved_batch} but "
                f"this sampler has global_batch={self.global_batch}. To continue from the "
                "checkpoint's sample cursor with the new global batch, build the sampler with "
                "ElasticSampler(..., allow_batch_change=True); else use the same global batch, "
                "or start a new checkpoint root."
            )
        cursor = int(state["cursor"])
        # The order at the cursor, over as many positions as the checkpoint digested: the
        # same data continues whatever the new batch (a batch change keeps the cursor).
        saved_next = state.get("next_batch_digest")
        if saved_next and self._order_digest(cursor, saved_batch) != saved_next:
            raise SamplerStateError(
                f"ElasticSampler: the checkpoint's data stream continues at cursor {cursor} with "
                f"batch digest {saved_next}, but this sampler's order gives "
                f"{self._order_digest(cursor, saved_batch)} there: samples would be skipped "
                "or repeated. Use the same dataset order (numpy version, seed), or start a new "
                "checkpoint root."
            )
        self.cursor = cursor
        self.consumed_digest = str(state.get("consumed_digest", ""))
        self._current = None
        self.batch_change = None
        if saved_batch != self.global_batch:
            self.batch_change = {
                "cursor": cursor,
                "old_global_batch": saved_batch,
                "new_global_batch": self.global_batch,
            }
            if self.rank == 0:
                logger.warning(
                    "rank 0: the global batch changes from %d to %d at sample cursor %d "
                    "(allow_batch_change=True): the data continues from that sample; each "
                    "step now consumes %d samples",
                    saved_batch, self.global_batch, cursor, self.global_batch,
                )  # fmt: skip

    def data_position(self) -> dict[str, Any]:
        """Cursor and digests (what a checkpoint's manifest records for auditing)."""
        return {
            "cursor": self.cursor,
            "consumed_digest": self.consumed_digest,
            "next_batch_digest": self._order_digest(self.cursor, self.global_batch),
        }


class _EpochBatches:
    """The ``batch_sampler`` of an :class:`EpochLoader`: this rank's ids of each planned batch.

    Iterated in the process that iterates the loader (workers get the indices), when
    the loader's iterator is made.
    """

    def __init__(self, sampler: ElasticSampler) -> None:
        self.sampler = sampler
        self.plan: list[tuple[int, int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        sampler = self.sampler
        for start, size in self.plan:
            lo, hi = rank_slice(size, sampler.world_size, sampler.rank)
            yield sampler._indices(start + lo, hi - lo)

    def __len__(self) -> int:
        return len(self.plan)


class EpochLoader:
    """One epoch per iteration from an :class:`ElasticSampler` (``sampler.epoch_loader()``).

    ``len(loader)``: global batches per epoch. ``for batch in loader``: the batches left
    in the cursor's epoch, each handed out as it reaches the loop body (the cursor moves
    then). ``set_epoch(e)``: :meth:`ElasticSampler.set_epoch`. ``loader.dataloader`` is
    the ``torch.utils.data.DataLoader`` behind it. Its ``generator`` (unless one is given)
    is reseeded from (seed, cursor) at each iteration, so worker seeds are a function of
    the data position, the same after a resume.
    """

    def __init__(self, sampler: ElasticSampler, dataset: Any, kwargs: dict[str, Any]) -> None:
        self.sampler = sampler
        self._own_generator = "generator" not in kwargs
        kwargs.setdefault("generator", torch.Generator())
        self._batches = _EpochBatches(sampler)
        self.dataloader = DataLoader(dataset, batch_sampler=self._batches, **kwargs)

    def __len__(self) -> int:
        return self.sampler.batches_per_epoch()

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        plan = sampler._plan_epoch_iteration()
        if not plan:
            return
        self._batches.plan = plan
        if self._own_generator:
            self.dataloader.generator.manual_seed(derive_seed(sampler.order.seed, plan[0][0]))
        for (start, size), batch in zip(plan, self.dataloader, strict=True):
            sampler._hand_out(start, size)
            yield batch
