"""Replication of memory snapshots to another node, on a background thread.

After a snapshot is committed on every rank's own node, each rank sends its shard to
the rank with the same local index on the next node (nodes in order of their first
rank), which checks it against the manifest's crc32c and stores it in its own slot of
that step. The sends go straight from the page cache (a read-only map of the shard
file); receive buffers are kept and reused. Jobs run one at a time, in snapshot order
on every rank, over a gloo group used by nothing else, at a low thread priority.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ckpt.errors import CorruptCheckpointError
from ckpt.format.checksum import crc32c_of
from ckpt.format.layout import shard_filename
from ckpt.saving.async_save import lower_thread_priority, save_thread_nice
from ckpt.tiers.memory import fs as memory_fs
from ckpt.tiers.memory import shard

logger = logging.getLogger(__name__)


def replica_targets(node_of: list[int], ranks_on: list[list[int]]) -> list[int]:
    """Rank r's replica goes to the rank of the same local index on the next node
    (empty with a single node: there is nowhere to replicate to)."""
    if len(ranks_on) < 2:
        return []
    out = []
    for r, node in enumerate(node_of):
        local = ranks_on[node].index(r)
        nxt = ranks_on[(node + 1) % len(ranks_on)]
        out.append(nxt[local % len(nxt)])
    return out


@dataclass(slots=True)
class Job:
    """One snapshot's replication."""

    step: int
    slot_dir: str
    sizes: list[int]
    crcs: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


class Replicator:
    """This rank's replication worker (one thread, started with the first job)."""

    def __init__(self, rank: int, target: int, sources: list[int], group: Any) -> None:
        self.rank, self.target, self.sources, self.group = rank, target, sources, group
        self.jobs: dict[int, Job] = {}
        """The last job of each slot (a slot is not rewritten before its job is done)."""
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._recv_bufs: dict[int, torch.Tensor] = {}

    def start(self, slot: int, job: Job) -> None:
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._work,
                args=(save_thread_nice(),),
                name="ckpt-memory-replicate",
                daemon=True,
            )
            self._worker.start()
        self.jobs[slot] = job
        self._queue.put(job)

    def wait_slot(self, slot: int) -> None:
        job = self.jobs.pop(slot, None)
        if job is not None:
            job.done.wait()

    def errors(self) -> list[str]:
        """Errors of finished jobs not reported yet."""
        out = []
        for job in self.jobs.values():
            if job.done.is_set() and job.error:
                out.append(f"step {job.step}: {job.error}")
                job.error = None
        return out

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in list(self.jobs.values()):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.done.wait(left):
                return False
        return True

    def stop(self) -> None:
        if self._worker is not None:
            self._queue.put(None)

    def _work(self, nice: int) -> None:
        lower_thread_priority(nice)
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._replicate(job)
            except Exception as exc:  # reported at the next snapshot; training goes on
                logger.warning(
                    "rank %d: replicating memory snapshot %d failed: %s", self.rank, job.step, exc
                )
                job.error = f"{type(exc).__name__}: {exc}"
            finally:
                job.done.set()

    def _replicate(self, job: Job) -> None:
        mine = os.path.join(job.slot_dir, shard_filename(self.rank))
        mapped = memory_fs.MappedFile(mine, job.sizes[self.rank])
        works = []
        try:
            for src in self.sources:
                buf = self._recv_bufs.get(src)
                if buf is None or buf.numel() != job.sizes[src]:
                    buf = self._recv_bufs[src] = torch.empty(job.sizes[src], dtype=torch.uint8)
                works.append(dist.irecv(buf, src=src, group=self.group))
            data = mapped.tensor(0, job.sizes[self.rank])
            works.append(dist.isend(data, dst=self.target, group=self.group))
            for work in works:
                work.wait()
        finally:
            works.clear()
            data = None
            mapped.close()
        for src in self.sources:
            view = memoryview(self._recv_bufs[src].numpy())
            if crc32c_of(view) != job.crcs[src]:
                raise CorruptCheckpointError(
                    f"replica of rank {src}'s shard of step {job.step} arrived with another crc32c"
                )
            with shard.ShardFile(os.path.join(job.slot_dir, shard_filename(src))) as out:
                out.write(view)
                out.finish(view.nbytes)
