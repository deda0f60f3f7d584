"""Dropout that does not depend on the world size: one RNG scope per global micro-batch.

A resume on the same world size restores each rank's RNG and continues bitwise. On
another world size there is no saved stream for the new ranks (``ckpt`` re-derives one
from ``(seed, step, rank)``), so a model that draws random numbers while training
(dropout) gets other masks, and its losses drift from the uninterrupted run (~1e-2 on a
small MLP after 2 -> 1 ranks). The fix is to key the randomness by *what* is computed,
never by *who* computes it: the masks of a micro-batch are drawn from a generator seeded
with ``(seed, step, global micro-batch index)``, inside :func:`sample_rng`::

    for mb in sampler.micro_batches(micro_batch=4):  # this rank's micro-batches of the step
        with mb.rng(seed):  # = elastic.sample_rng(seed, mb.step, mb.index)
            loss = loss_fn(model(x[mb.local]), y[mb.local])
            loss.backward()

What it needs: the same micro-batch size on every world size (the global micro-batch
``j`` of a step covers the same global sample positions ``step_start + j*m ..`` only if
``m`` is fixed), so the per-rank batch ``global_batch / world_size`` must be a multiple
of it: gradient accumulation over ``global_batch / (world_size * m)`` micro-batches.
The built-in trainer uses the same scope (``trainer/loop.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from elastic.errors import MicroBatchSplitError

DROPOUT_STREAM = 0xD0
"""Last part of the key of every micro-batch seed (separates it from other derived streams)."""


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of the integer ``parts`` (any rank, any process)."""
    blob = ",".join(str(int(p)) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") & ((1 << 63) - 1)


def micro_batch_seed(seed: int, step: int, micro_index: int) -> int:
    """The seed of global micro-batch ``micro_index`` of ``step`` (what :func:`sample_rng` uses)."""
    if micro_index < 0:
        raise ValueError(f"micro_index must be >= 0, got {micro_index}")
    return derive_seed(seed, step, micro_index, DROPOUT_STREAM)


def _cuda_devices() -> list[int]:
    # Only a CUDA context that already exists: forking an uninitialized one would create a
    # context (and take GPU memory) in a CPU-only job that happens to run on a GPU host.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.cuda.current_device()]
    return []


@contextmanager
def sample_rng(seed: int, step: int, micro_index: int) -> Iterator[int]:
    """Draw random numbers for one global micro-batch from a rank-independent stream.

    Inside the block, the default CPU generator and (when CUDA is initialized) the
    current CUDA device's generator are seeded with :func:`micro_batch_seed` ``(seed,
    step, micro_index)``; on exit both get back the state they had before, so the rest
    of the process stream is unchanged. Put the forward of the micro-batch inside it,
    and the backward too when the model draws random numbers there. Yields the seed.

    Any rank calls it, independently (no collective). ``step`` is any step numbering
    that is the same on every world size (the built-in trainer and
    :meth:`elastic.ElasticSampler.micro_batches` use the 1-based optimizer step);
    ``micro_index`` is the micro-batch's index in the step's *global* batch, never the
    rank's: equal masks on every world size need the same micro-batch size on all of
    them. Generators a user created (``torch.Generator()``) are not touched.
    """
    value = micro_batch_seed(seed, step, micro_index)
    devices = _cuda_devices()
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(value)
        for device in devices:
            torch.cuda.default_generators[device].manual_seed(value)
        yield value


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch of this rank's batch, and where it sits in the global batch."""

    step: int
    """1-based optimizer step the micro-batch belongs to (global batches consumed + 1);
    0 for a batch off the regular grid (:func:`plan_micro_batches_at`)."""
    index: int
    """Index of the micro-batch in the step's global batch (the same on every world size);
    with ``step`` 0, its first global sample position."""
    first_position: int
    """Global sample position (the sampler's cursor scale) of its first sample."""
    local: slice
    """Its rows in this rank's local batch (``x[mb.local]``)."""

    def rng(self, seed: int) -> AbstractContextManager[int]:
        """``elastic.sample_rng(seed, self.step, self.index)``: the scope for its forward."""
        return sample_rng(seed, self.step, self.index)


def plan_micro_batches(
    cursor: int, global_batch: int, world_size: int, rank: int, micro_batch: int
) -> list[MicroBatch]:
    """Rank ``rank``'s micro-batches of ``micro_batch`` samples of the global batch at ``cursor``.

    Rank ``r`` of ``W`` holds positions ``[cursor + r*B/W, cursor + (r+1)*B/W)``
    (:class:`elastic.ElasticSampler`), so its ``k``-th micro-batch is global micro-batch
    ``r * (B/W)/m + k``. Pure; raises :class:`MicroBatchSplitError` when ``B/W`` is not a
    multiple of ``m``.
    """
    if micro_batch < 1:
        raise MicroBatchSplitError(f"micro_batch must be >= 1, got {micro_batch}")
    if global_batch % world_size:
        raise MicroBatchSplitError(
            f"global_batch={global_batch} is not divisible by world_size={world_size}"
        )
    local_batch = global_batch // world_size
    if local_batch % micro_batch:
        raise MicroBatchSplitError(
            f"the per-rank batch global_batch/world_size = {global_batch}/{world_size} = "
            f"{local_batch} is not a multiple of micro_batch={micro_batch}: dropout masks are "
            "drawn per micro-batch of global positions, so keep one micro-batch size on every "
            "world size and pick one that divides the per-rank batch of each (e.g. "
            f"micro_batch=1, or a global batch that is a multiple of {world_size * micro_batch})"
        )
    if cursor % global_batch:
        raise MicroBatchSplitError(
            f"cursor={cursor} is not at a global batch boundary (global_batch={global_batch})"
        )
    step = cursor // global_batch + 1
    per_rank = local_batch // micro_batch
    first = cursor + rank * local_batch
    return [
        MicroBatch(
            step=step,
            index=rank * per_rank + k,
            first_position=first + k * micro_batch,
            local=slice(k * micro_batch, (k + 1) * micro_batch),
        )
        for k in range(per_rank)
    ]


def rank_slice(batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows ``[lo, hi)`` of a global batch of ``batch_size`` samples.

    Contiguous and as even as it gets: ``[r*k//W, (r+1)*k//W)``; for a batch divisible by
    the world size, ``[r*k/W, (r+1)*k/W)``. Pure.
    """
    return rank * batch_size // world_size, (rank + 1) * batch_size // world_size


def plan_micro_batches_at(
    start: int, batch_size: int, world_size: int, rank: int, micro_batch: int
) -> list[MicroBatch]:
    """Rank ``rank``'s micro-batches of a global batch off the regular grid.

    A batch whose start is not a multiple of the global batch (after a global batch
    change) or that is shorter (an epoch's last batch): this rank's rows
    (:func:`rank_slice`) in pieces of ``micro_batch`` (the last may be shorter), each
    keyed by its first global sample position (``MicroBatch.step`` 0,
    ``MicroBatch.index`` the position), so its dropout masks stay a function of the
    samples. Pure.
    """
    if micro_batch < 1:
        raise MicroBatchSplitError(f"micro_batch must be >= 1, got {micro_batch}")
    lo, hi = rank_slice(batch_size, world_size, rank)
    out = []
    for first in range(lo, hi, micro_batch):
        last = min(first + micro_batch, hi)
        out.append(
            MicroBatch(
                step=0,
                index=start + first,
                first_position=start + first,
                local=slice(first - lo, last - lo),
            )
        )
    return out
