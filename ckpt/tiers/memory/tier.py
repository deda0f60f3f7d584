"""The memory tier of a :class:`~ckpt.manager.CheckpointManager`: snapshots kept in node
memory, replicated to another node, so a restart resumes from a step newer than the last
durable checkpoint.

torchrun restarts every worker process after a failure, so a copy kept only in a
process's heap dies with it. Each rank keeps its snapshots in files under a node-local
tmpfs directory that outlives the process (layout: :mod:`ckpt.tiers.memory.layout`). A node is
a host and a base directory (the tests give each simulated node its own base).

A snapshot (every ``memory_every`` steps, :meth:`MemoryTier.snapshot`) is taken in the
caller's thread: each rank writes its shard into the slot that does not hold its newest
committed snapshot, one all_gather over the tier's own gloo group exchanges sizes and
checksums (and proves every rank wrote), then every rank writes ``.metadata``,
``manifest.json`` and ``COMMIT``. When it returns, the step survives the death of any
process. A background thread then sends each rank's shard to a rank on the next node
(same local index), over a second gloo group, so the loss of a whole node is covered
once that finishes; a replica is checked against the manifest's crc32c on arrival and
again before any use. Two slots per rank: the newest two snapshots, files reused in place.

Resume (:mod:`ckpt.tiers.memory.restore`) gathers what every node holds, picks the newest
snapshot that is complete across the surviving nodes and newer than the newest durable
checkpoint, verifies and ships the shards, and loads them with the normal verified
``ckpt.load``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ckpt import env
from ckpt.dist import Collective, new_checkpoint_group
from ckpt.errors import SnapshotError
from ckpt.format.checksum import crc32c_of, encode_crc32c
from ckpt.format.layout import DCP_METADATA_NAME, MANIFEST_NAME, shard_filename
from ckpt.format.manifest import Attempt, CompleteMarker, FileEntry, Manifest
from ckpt.saving import finite
from ckpt.saving.commit import process_start_time, utc_now
from ckpt.state.state_check import checked_state
from ckpt.tiers.memory import fs as memory_fs
from ckpt.tiers.memory import shard
from ckpt.tiers.memory.layout import (
    COMMIT_NAME,
    SLOTS,
    MemoryDirError,
    SlotInfo,
    choose_memory_dir,
    compact_manifest,
    listdir,
    memory_base_dir,
    pick_slot,
    read_slot,
    remove_other_launches,
    remove_slot,
    run_key,
    secure_base_dir,
    unlink,
    write_file,
)
from ckpt.tiers.memory.replicate import Job, Replicator, replica_targets

logger = logging.getLogger(__name__)

CLOSE_WAIT_S = 10.0
FAST_META_BYTES = 8192
"""Rank 0's manifest metadata travels in the snapshot's one all_gather up to this size."""


class MemoryTier:
    """One rank's part of the memory tier (built by the manager on every rank: collective)."""

    def __init__(
        self,
        root: str,
        *,
        memory_dir: str | None = None,
        distributed: bool,
        allow_non_finite: bool | Sequence[str] = False,
    ) -> None:
        memory_fs.install()  # ckptmem://, what a resume from this tier loads from
        self.allow_non_finite = allow_non_finite
        """Keys whose non-finite values do not stop a snapshot (:mod:`ckpt.saving.finite`)."""
        # Another user's default directory gives way to a fallback of ours; an error waits
        # for the collective below, so that every rank raises it together.
        base_error: MemoryDirError | None = None
        try:
            self.base = choose_memory_dir(memory_dir)
        except MemoryDirError as exc:
            self.base, base_error = memory_base_dir(memory_dir), exc
        # Two gloo groups of its own: snapshot collectives (caller's thread) and the
        # replication sends (background thread) never interleave with each other, with
        # training, or with the durable tier's background save.
        self.group = new_checkpoint_group() if distributed else None
        self.repl_group = new_checkpoint_group() if distributed else None
        coll = Collective(self.group)
        self.rank, self.world_size = coll.rank, coll.world_size
        host = socket.gethostname()
        run_id, restart_count = env.run_identity()
        me = {
            "host": host,
            "node": f"{host}:{os.path.realpath(self.base)}",
            "pid": os.getpid(),
            "run_id": run_id,
            "restart_count": restart_count,
        }
        self.peers: list[dict[str, Any]] = coll.all_gather(me)
        self.nonce: str = coll.broadcast(uuid.uuid4().hex[:12])
        self.run_id = str(self.peers[0]["run_id"])
        self.restart_count = max(int(p["restart_count"]) for p in self.peers)
        self.started_at = process_start_time()
        self.run_dir = os.path.join(self.base, run_key(self.run_id, root))
        self.holder_dir = os.path.join(self.run_dir, f"h{self.rank:05d}")
        self.nodes: list[str] = []
        for peer in self.peers:
            if peer["node"] not in self.nodes:
                self.nodes.append(peer["node"])
        self.node_of = [self.nodes.index(p["node"]) for p in self.peers]
        self.ranks_on = [
            [r for r, n in enumerate(self.node_of) if n == i] for i in range(len(self.nodes))
        ]
        self.is_node_reader = self.ranks_on[self.node_of[self.rank]][0] == self.rank
        self.target = replica_targets(self.node_of, self.ranks_on)
        self.sources = [r for r, t in enumerate(self.target) if t == self.rank and r != self.rank]
        self._replicator = (
            Replicator(self.rank, self.target[self.rank], self.sources, self.repl_group)
            if self.target
            else None
        )

        # Every rank fails alike when the directory is not safely this user's (another
        # user's, a link, group-writable) or cannot be created (a full tmpfs): the error
        # names it and the fix (memory_dir or CKPT_MEMORY_DIR).
        def make_dirs() -> None:
            if base_error is not None:
                raise base_error
            secure_base_dir(self.base)
            os.makedirs(self.holder_dir, mode=0o700, exist_ok=True)

        coll.on_every_rank(f"creating the memory tier directory {self.holder_dir}", make_dirs)
        self.resumed = False
        self.newest_step: int | None = None
        self.last_snapshot_s: float | None = None
        self.last_phases: dict[str, float] = {}
        """Seconds of the last snapshot's parts: prepare, write, gather, commit (this rank)."""
        self.replan_count = 0
        self.last_restore: dict[str, float] = {}
        """This rank's transfer counts and waits of the last memory resume (see
        :class:`ckpt.tiers.memory.restore.Restore`)."""
        self._layout: shard.ShardLayout | None = None
        self._slots: list[SlotInfo | None] | None = None
        self._orphans_removed = False
        if self.is_node_reader:
            remove_other_launches(self.base, os.path.basename(self.run_dir))

    # -- snapshot --------------------------------------------------------------------------

    def snapshot(self, step: int, state: dict[str, Any], metadata: dict[str, Any]) -> None:
        """Write and commit this step's snapshot on every rank's node (collective).

        Raises :class:`SnapshotError` (on every rank alike, up to the local commit files)
        when it was not committed; the previous snapshot stays.
        """
        started = time.monotonic()
        coll = Collective(self.group)
        slots = self._slot_state()
        slot = pick_slot(slots)
        if self._replicator is not None:  # a replication may still read or write that slot
            self._replicator.wait_slot(slot)
        slot_dir = os.path.join(self.holder_dir, f"slot{slot}")
        os.makedirs(slot_dir, mode=0o700, exist_ok=True)
        unlink(os.path.join(slot_dir, COMMIT_NAME))  # the slot's old snapshot is gone now
        slots[slot] = None
        expected = {shard_filename(r) for r in (self.rank, *self.sources)}
        for name in listdir(slot_dir):  # replicas of a former topology
            if name.endswith(".distcp") and name not in expected:
                unlink(os.path.join(slot_dir, name))
        mine = shard_filename(self.rank)
        path = os.path.join(slot_dir, mine)
        error, written = None, None
        phases = {"prepare_s": time.monotonic() - started}
        try:
            state = checked_state(state)  # what a resume could not load back is refused
            if shard.set_up(self._layout, state, self.rank == 0):
                assert self._layout is not None
                written = shard.fast_write(self._layout, path)
                error = self._non_finite(written)
        except Exception as exc:  # reported to every rank through the gather below
            logger.debug("rank %d: memory snapshot write failed", self.rank, exc_info=True)
            error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        phases["write_s"] = time.monotonic() - started - phases["prepare_s"]
        reports = self._gather(coll, error, written, metadata)
        phases["gather_s"] = time.monotonic() - started - phases["prepare_s"] - phases["write_s"]
        errors = [r["error"] for r in reports if r["error"]]
        if errors:
            raise SnapshotError(f"memory snapshot of step {step} failed: {'; '.join(errors)}")
        if any(r["replan"] for r in reports):
            try:
                self._layout, written = shard.planned_write(
                    state, lambda name: os.path.join(slot_dir, name), coll
                )
            except Exception as exc:  # DCP raises a failure on any rank on every rank
                raise SnapshotError(
                    f"memory snapshot of step {step} failed while planning: {type(exc).__name__}: {exc}"
                ) from exc
            self.replan_count += 1
            reports = coll.all_gather(self._report(self._non_finite(written), written, metadata))
            errors = [r["error"] for r in reports if r["error"]]
            if errors:
                raise SnapshotError(f"memory snapshot of step {step} failed: {'; '.join(errors)}")
        layout = self._layout
        assert layout is not None
        for r, report in enumerate(reports):
            layout.update_spans(shard_filename(r), [(c[0], c[1]) for c in report["chunks"]])
        metadata_bytes = layout.metadata_bytes()
        attempt = Attempt(
            run_id=self.run_id, restart_count=self.restart_count, save_id=f"{self.nonce}-{step}"
        )
        files = [
            FileEntry(path=shard_filename(r), size=rep["size"], crc32c=rep["crc"])
            for r, rep in enumerate(reports)
        ]
        files.append(
            FileEntry(
                path=DCP_METADATA_NAME, size=len(metadata_bytes), crc32c=crc32c_of(metadata_bytes)
            )
        )
        manifest = Manifest(
            step=step,
            created_at=reports[0]["created_at"],
            world_size=self.world_size,
            attempt=attempt,
            membership=[
                {"rank": r, "host": p["host"], "pid": p["pid"]} for r, p in enumerate(self.peers)
            ],
            torch_version=torch.__version__,
            files=sorted(files, key=lambda e: e.path),
            chunks={shard_filename(r): rep["chunks"] for r, rep in enumerate(reports)},
            metadata=reports[0]["meta"],
        )
        if self._replicator is not None:  # on every rank alike: the gather succeeded everywhere
            sizes, crcs = [r["size"] for r in reports], [r["crc"] for r in reports]
            self._replicator.start(slot, Job(step, slot_dir, sizes, crcs))
        manifest_bytes = compact_manifest(manifest)
        write_file(os.path.join(slot_dir, DCP_METADATA_NAME), metadata_bytes)
        write_file(os.path.join(slot_dir, MANIFEST_NAME), manifest_bytes)
        marker = CompleteMarker(
            step=step,
            attempt=attempt,
            manifest_crc32c=crc32c_of(manifest_bytes),
            committed_at=utc_now(),
        )
        write_file(os.path.join(slot_dir, COMMIT_NAME), marker.to_bytes())
        slots[slot] = SlotInfo(step, attempt.save_id, self.restart_count)
        self.newest_step = step
        if not self._orphans_removed:
            self._remove_orphans()
        self.last_snapshot_s = time.monotonic() - started
        phases["commit_s"] = self.last_snapshot_s - sum(phases.values())
        self.last_phases = phases

    def _non_finite(self, written: shard.WrittenShard | None) -> str | None:
        """Why this rank's shard must not be committed: a tensor held NaN or inf."""
        keys = finite.refused(written.non_finite if written else (), self.allow_non_finite)
        if not keys:
            return None
        return (
            f"rank {self.rank}: non-finite values (NaN or inf) in {', '.join(keys[:8])}"
            f"{' and more' if len(keys) > 8 else ''}: a diverged state is never snapshotted"
        )

    def _gather(
        self,
        coll: Collective,
        error: str | None,
        written: shard.WrittenShard | None,
        metadata: dict[str, Any],
    ) -> list[dict[str, Any]]:
        """Every rank's report. The usual case (layout unchanged, nothing failed) is one
        all_gather of a small int64 tensor per rank (item and file crc32c; rank 0 adds the
        manifest metadata); anything else, every rank then exchanges full reports."""
        layout = self._layout
        if layout is None or coll.group is None:
            return coll.all_gather(self._report(error, written, metadata))
        n_max = layout.max_items
        mine = shard_filename(self.rank)
        status, meta = 0, b""
        if error is not None:
            status = 1
        elif written is None:
            status = 2
        elif [(c[0], c[1]) for c in written.chunks] != layout.spans.get(mine, []):
            status = 3
        elif self.rank == 0:
            meta = json.dumps({"meta": metadata, "created_at": utc_now()}).encode()
            status = 4 if len(meta) > FAST_META_BYTES else 0
        words = np.zeros(5 + n_max + FAST_META_BYTES // 8, dtype=np.int64)
        if status == 0 and written is not None:
            n = len(written.item_crcs)
            words[:5] = (0, written.size, written.crc_value, n, len(meta))
            words[5 : 5 + n] = written.item_crcs
            words[5 + n_max :].view(np.uint8)[: len(meta)] = np.frombuffer(meta, dtype=np.uint8)
        else:
            words[0] = status
        mine_t = torch.from_numpy(words)
        gathered = [torch.empty_like(mine_t) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine_t, group=coll.group)
        rows = [g.numpy() for g in gathered]
        if any(int(row[0]) != 0 for row in rows):
            return coll.all_gather(self._report(error, written, metadata))
        reports = []
        for r, row in enumerate(rows):
            spans = layout.spans.get(shard_filename(r), [])
            n = int(row[3])
            if n != len(spans):
                raise SnapshotError(f"rank {r} reported {n} items, the layout has {len(spans)}")
            crcs = [encode_crc32c(int(c)) for c in row[5 : 5 + n]]
            reports.append({
                "error": None, "replan": False, "size": int(row[1]),
                "crc": encode_crc32c(int(row[2])),
                "chunks": [[o, length, c] for (o, length), c in zip(spans, crcs, strict=True)],
            })  # fmt: skip
        head = rows[0]
        extra = json.loads(head[5 + n_max :].view(np.uint8)[: int(head[4])].tobytes())
        reports[0]["meta"], reports[0]["created_at"] = extra["meta"], extra["created_at"]
        return reports

    def _report(
        self, error: str | None, written: shard.WrittenShard | None, metadata: dict[str, Any]
    ) -> dict[str, Any]:
        report: dict[str, Any] = {
            "error": error,
            "replan": error is None and written is None,
            "size": written.size if written else 0,
            "crc": written.crc32c if written else "",
            "chunks": written.chunks if written else [],
        }
        if self.rank == 0:
            report["meta"] = metadata
            report["created_at"] = utc_now()
        return report

    def pruned(self, newest_step: int | None) -> None:
        """A resume kept ``newest_step``'s snapshot (None: none) and removed the others:
        what this holder has on disk is read again at the next snapshot, and older
        attempts' slots are no longer stale (the resume already chose among them)."""
        self.resumed = True
        self._slots = None
        self.newest_step = newest_step

    def _slot_state(self) -> list[SlotInfo | None]:
        if self._slots is None:
            if not self.resumed:
                self._drop_stale_slots()
            self._slots = [
                read_slot(os.path.join(self.holder_dir, f"slot{i}")) for i in range(SLOTS)
            ]
        return self._slots

    def _drop_stale_slots(self) -> None:
        """First snapshot without a resume: older attempts' snapshots here are history that
        this attempt did not continue; remove them so that a later resume cannot pick them."""
        for i in range(SLOTS):
            slot_dir = os.path.join(self.holder_dir, f"slot{i}")
            info = read_slot(slot_dir)
            if info is None or info.restart_count < self.restart_count:
                remove_slot(slot_dir)
        self._remove_orphans()

    def _remove_orphans(self) -> None:
        """The node's first rank removes holders of ranks this world does not have (a
        larger earlier world); after a resume, once this attempt has its own snapshot."""
        self._orphans_removed = True
        if not self.is_node_reader:
            return
        for name in listdir(self.run_dir):
            if name.startswith("h") and name[1:].isdigit() and int(name[1:]) >= self.world_size:
                shutil.rmtree(os.path.join(self.run_dir, name), ignore_errors=True)

    def replication_errors(self) -> list[str]:
        """Errors of finished replications since the last call (for events)."""
        return self._replicator.errors() if self._replicator else []

    def wait_replication(self, timeout: float | None = None) -> bool:
        return self._replicator.wait(timeout) if self._replicator else True

    # -- lifetime --------------------------------------------------------------------------

    def close(self, durable_step: int | None) -> None:
        """Finish replication; drop this rank's snapshots if the durable tier caught up."""
        drained = self.wait_replication(CLOSE_WAIT_S)
        if self._replicator is not None:
            self._replicator.stop()
        if drained:  # no reference to the groups may outlive destroy_process_group
            self.group = self.repl_group = None
        if not drained:
            logger.warning("rank %d: memory snapshot replication still running at close", self.rank)
            return
        if durable_step is not None and (
            self.newest_step is None or durable_step >= self.newest_step
        ):
            shutil.rmtree(self.holder_dir, ignore_errors=True)
            try:
                os.rmdir(self.run_dir)
            except OSError:
                pass

    def url(self, step: int) -> str:
        return f"{self.run_dir}#step={step}"
