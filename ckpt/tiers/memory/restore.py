"""Resume from the memory tier: which snapshot, verified copies, shipped to every rank.

Collective over the tier's gloo groups, in three calls the manager makes in order:

1. :func:`survey`: the first rank of each node lists what the node holds (every slot of
   every holder directory: its COMMIT record, manifest and files); every rank gets the
   same list and computes the same candidates: snapshots with a valid commit record,
   newer than the newest durable checkpoint and not fenced by it, with every file the
   manifest lists present (right size) on some surviving node; newest first.
2. :func:`materialize`: every rank gets a ``ckptmem://`` root (:mod:`ckpt.tiers.memory.fs`)
   holding the candidate: the files its node has, mapped read-only (the values of the
   tensor items it loads whole read straight into their tensors); from a node that has
   the others, only the byte ranges its own load plan reads, shipped over gloo; plus
   manifest.json, COMPLETE (the snapshot's commit record) and ``.metadata``. The manager
   then runs the normal verified ``ckpt.load`` on it (every item's crc32c checked,
   resharding to this world size). The first attempt trusts the copies it maps (the
   item checksums decide); if the load fails, a second one first checks the crc32c of
   every copy against the manifest on its node and uses only those that match, so a
   corrupted copy falls back to a replica before the snapshot is given up.

   The shipping is pipelined with the load: the ranges are posted as chunks
   (:data:`CHUNK_BYTES`) before ``materialize`` returns, a read of the root waits only
   for the chunks it covers, so the loader checks (crc32c) the first items while the
   later ones are on the wire, and a sending rank loads its own shard while its sends
   drain. The values of a tensor item that this rank loads whole into one contiguous
   tensor are received straight into that tensor (:func:`_segments`; where they lie in
   the item is read from the sender's node, :func:`ckpt.format.tensorblob.data_layout`); only
   the items' headers land in new buffers. A restarted process so receives into memory
   it already touched (its parameters and optimizer state) and copies nothing, which
   shortens the peer restore and, most of all, the receiving load's wait for its bytes
   (bench ``memory_tier``). :meth:`Restore.release` waits for every transfer.
3. :func:`prune`: keep only the snapshot resumed from (none after a durable resume):
   anything else here is older, or newer but unusable, a history this run did not take.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType

from ckpt.dist import Collective
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.format.checksum import crc32c_of
from ckpt.format.layout import COMPLETE_NAME, DCP_METADATA_NAME, MANIFEST_NAME, checkpoint_dirname
from ckpt.format.manifest import Manifest
from ckpt.format.tensorblob import data_layout
from ckpt.loading.reader import SafeLoadPlanner, load_metadata
from ckpt.tiers.memory import fs as memory_fs
from ckpt.tiers.memory.layout import (
    COMMIT_NAME,
    SLOTS,
    open_private,
    read_commit,
    read_private,
    remove_slot,
)
from ckpt.tiers.memory.tier import MemoryTier

logger = logging.getLogger(__name__)

MAX_NOTES = 8


@dataclass(slots=True)
class Candidate:
    """A committed memory snapshot and where its files are."""

    save_id: str
    step: int
    restart_count: int
    manifest: Manifest
    manifest_bytes: bytes
    commit_bytes: bytes
    copies: dict[str, list[tuple[int, str, int]]] = field(default_factory=dict)
    """File name -> ``(node reader rank, path, size)`` of each copy in a committed slot."""


@dataclass(slots=True)
class Survey:
    candidates: list[Candidate]
    """Usable snapshots, newest first."""
    notes: list[str]
    """Why other snapshots were passed over (newest first, at most a few)."""
    newest_step: int | None
    """Newest committed memory step seen anywhere (usable or not)."""


def survey(tier: MemoryTier, durable: tuple[int, str, int] | None) -> Survey:
    """What the memory tier offers; ``durable`` is the newest durable commit's
    ``(step, run_id, restart_count)``. Collective; the same result on every rank."""
    coll = Collective(tier.group)
    reports = coll.all_gather(_scan(tier.run_dir) if tier.is_node_reader else None)
    found: dict[str, Candidate] = {}
    partial: list[tuple[int, str]] = []
    for reader, report in enumerate(reports):
        for entry in report or []:
            if "reason" in entry:
                partial.append((-1, f"{entry['dir']}: {entry['reason']}"))
                continue
            cand = found.get(entry["save_id"])
            if cand is None and entry.get("manifest") is not None:
                cand = found[entry["save_id"]] = Candidate(
                    save_id=entry["save_id"],
                    step=entry["step"],
                    restart_count=entry["restart_count"],
                    manifest=Manifest.from_bytes(entry["manifest"], url=entry["dir"]),
                    manifest_bytes=entry["manifest"],
                    commit_bytes=entry["commit"],
                )
            if cand is None:
                continue
            for name, size in entry["files"].items():
                cand.copies.setdefault(name, []).append(
                    (reader, os.path.join(entry["dir"], name), size)
                )
    ranked = sorted(found.values(), key=lambda c: (c.step, c.restart_count), reverse=True)
    notes: list[str] = []
    usable: list[Candidate] = []
    for cand in ranked:
        why = _unusable(cand, durable)
        if why is None:
            usable.append(cand)
        else:
            notes.append(why)
    notes.extend(reason for _, reason in partial)
    return Survey(usable, notes[:MAX_NOTES], ranked[0].step if ranked else None)


def _unusable(cand: Candidate, durable: tuple[int, str, int] | None) -> str | None:
    if durable is not None:
        d_step, d_run, d_count = durable
        if cand.step <= d_step:
            return f"memory step {cand.step} is not newer than durable step {d_step}"
        if d_run == cand.manifest.attempt.run_id and d_count > cand.restart_count:
            return (
                f"memory step {cand.step} was written by attempt {cand.restart_count}, older than "
                f"the attempt {d_count} that committed durable step {d_step} (fenced)"
            )
    for entry in cand.manifest.files:
        sizes = [size for _, _, size in cand.copies.get(entry.path, [])]
        if entry.size not in sizes:
            where = "has the wrong size on every node" if sizes else "is on no surviving node"
            return f"memory step {cand.step}: {entry.path} {where}"
    return None


def _scan(run_dir: str) -> list[dict[str, Any]]:
    """Every slot of every holder directory on this node."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for holder in _listdir(run_dir):
        if not (holder.startswith("h") and holder[1:].isdigit()):
            continue
        for i in range(SLOTS):
            slot_dir = os.path.join(run_dir, holder, f"slot{i}")
            if not os.path.isdir(slot_dir):
                continue
            files = {
                name: os.path.getsize(os.path.join(slot_dir, name))
                for name in _listdir(slot_dir)
                if name.endswith(".distcp") or name == ".metadata"
            }
            loaded = read_commit(slot_dir)
            if isinstance(loaded, str):
                out.append({"dir": slot_dir, "reason": loaded})
                continue
            marker, _, raw = loaded
            try:
                commit = read_private(os.path.join(slot_dir, COMMIT_NAME))
            except OSError as exc:
                out.append({"dir": slot_dir, "reason": f"COMMIT unreadable: {exc}"})
                continue
            save_id = marker.attempt.save_id
            out.append({
                "dir": slot_dir, "step": marker.step, "save_id": save_id,
                "restart_count": marker.attempt.restart_count,
                "manifest": None if save_id in seen else raw,
                "commit": commit, "files": files,
            })  # fmt: skip
            seen.add(save_id)
    return out


class Restore:
    """One assembled memory snapshot: the root to load from; :meth:`release` after the load.

    ``stats`` (this rank): ``received_bytes``/``sent_bytes`` over gloo, ``chunks``,
    ``placed_bytes`` (received straight into their destination), ``read_in_place_bytes``
    (values of this node's files read straight into their destination),
    ``wait_s`` (time the loader's reads blocked for bytes still on the wire) and
    ``settle_s`` (time :meth:`release` waited for this rank's sends and receives).
    """

    def __init__(
        self,
        key: str,
        url: str,
        sender: _Sender | None = None,
        pieces: list[memory_fs.Arriving] | None = None,
        stats: dict[str, float] | None = None,
    ) -> None:
        self.key, self.url = key, url
        self._sender = sender
        self._pieces = pieces or []
        self.stats: dict[str, float] = stats or {}

    def release(self) -> None:
        """Wait until the peers have this rank's bytes and its own receives are done
        (gloo reads and writes these buffers until then), then unmap and drop them."""
        began = time.perf_counter()
        error = self._sender.settle() if self._sender is not None else None
        if error is not None:  # the receiving rank's load fails on its side and says why
            logger.warning("memory restore: a send to another rank failed: %s", error)
        self._sender = None
        memory_fs.release(self.key)  # settles the receives, closes the maps
        self.stats["settle_s"] = time.perf_counter() - began
        self.stats["wait_s"] = sum(p.waited_s for p in self._pieces)
        self._pieces = []


CHUNK_BYTES = 8 << 20
"""Transfers go in messages of this size: a read waits only for the chunks it covers."""


def materialize(
    tier: MemoryTier, cand: Candidate, template: dict[str, Any], *, verify: bool
) -> Restore:
    """Make ``cand`` readable by this rank under a ``ckptmem://`` root (collective).

    The first rank of each node offers the copies its node holds (with ``verify``, only
    copies whose crc32c matches the manifest; without, the loader's item checksums are
    the check, and the caller retries with ``verify`` when they fail). Every rank then
    maps the files its node has and receives, from a node that has them, only the byte
    ranges of the other files that its own load plan (``template`` against the
    snapshot's ``.metadata``) reads. Raises :class:`~ckpt.errors.CorruptCheckpointError`
    (or ``StateMismatchError`` when the state does not fit) on every rank alike.

    The transfers are posted, not waited for: ranges arrive in :data:`CHUNK_BYTES`
    messages into their final buffers while the load runs, and a read of the root waits
    only for the chunks it covers; a sending rank's load runs while its bytes go out.
    :meth:`Restore.release` (always, after the load) waits for both.
    """
    coll = Collective(tier.group)
    url = tier.url(cand.step)
    entries = {e.path: e for e in cand.manifest.files}
    first_reader = tier.ranks_on[0][0]
    offered = coll.all_gather(
        _offer(tier.rank, cand, entries, verify, with_metadata=tier.rank == first_reader)
        if tier.is_node_reader
        else None
    )
    holders: dict[str, list[int]] = {}
    for name in sorted(entries):
        holders[name] = [r for r, offer in enumerate(offered) if offer and name in offer["good"]]
        if not holders[name]:
            bad = [why for offer in offered if offer for n, why in offer["bad"] if n == name]
            raise CorruptCheckpointError(
                f"memory snapshot of step {cand.step}: no copy of {name} verifies "
                f"({'; '.join(bad) or 'no copy'})",
                url=url,
                path=name,
            )
    reader = tier.ranks_on[tier.node_of[tier.rank]][0]
    here = offered[reader]["good"] if offered[reader] else {}
    # .metadata (every rank plans its reads with it): it came with node 0's offer, else
    # from the first node that has it.
    raw = (offered[first_reader] or {}).get("metadata")
    if raw is None:
        src = holders[DCP_METADATA_NAME][0]
        raw = coll.all_gather(
            _read_whole(offered[src]["good"][DCP_METADATA_NAME]) if tier.rank == src else None
        )[src]
    if crc32c_of(raw) != entries[DCP_METADATA_NAME].crc32c:
        raise CorruptCheckpointError(
            f"memory snapshot of step {cand.step}: .metadata does not verify",
            url=url,
            path=DCP_METADATA_NAME,
        )
    # Map this node's copies (to load, and to send from) and plan this rank's reads; one
    # gather then tells every rank what every other needs, or that some rank cannot go on.
    files: dict[str, memory_fs.SnapshotFile] = {}
    local: dict[str, memory_fs.LocalFile] = {}
    mine: dict[str, list[tuple[int, int]]] = {}
    targets: dict[str, dict[int, torch.Tensor]] = {}
    plan_error: CheckpointError | None = None
    map_error = None
    metadata = None
    try:
        for name, path in here.items():
            if name != DCP_METADATA_NAME:
                files[name] = memory_fs.MappedFile(path, entries[name].size)
        metadata = load_metadata(raw, url=url, manifest=cand.manifest)
        wanted, whole = _plan_reads(template, metadata)
        mine = {name: spans for name, spans in wanted.items() if name not in here}
        targets = {name: whole[name] for name in mine if whole.get(name)}
        local = _local_reads(files, wanted, whole, metadata)
    except CheckpointError as exc:
        plan_error = exc
    except OSError as exc:
        map_error = f"rank {tier.rank}: {type(exc).__name__}: {exc}"
    direct = {  # shipped items this rank could receive straight into their destination
        name: {off: _shape_of(t) for off, t in per.items()} for name, per in targets.items()
    }
    reports = coll.all_gather(
        {"needs": None if plan_error or map_error else mine, "error": map_error, "direct": direct}
    )
    errors = [r["error"] for r in reports if r["error"]]
    if plan_error is not None or errors or any(r["needs"] is None for r in reports):
        for f in [*local.values(), *files.values()]:
            f.close()
        if plan_error is not None:
            raise plan_error
        if errors:
            raise CorruptCheckpointError(
                f"memory snapshot of step {cand.step} could not be assembled: {'; '.join(errors)}",
                url=url,
            )
        raise CorruptCheckpointError(
            f"memory snapshot of step {cand.step}: another rank cannot plan its load", url=url
        )
    assert metadata is not None
    transfers = [
        (name, holders[name][dst % len(holders[name])], dst, spans)
        for dst, need in enumerate(r["needs"] for r in reports)
        for name, spans in sorted(need.items())
    ]
    layouts = _layouts(coll, tier, reports, files, metadata)
    plan = [
        (name, src, dst, _segments(spans, reports[dst]["direct"].get(name, {}),
                                   layouts[src].get(name, {}), metadata, name))
        for name, src, dst, spans in transfers
    ]  # fmt: skip
    incoming, sender, stats, placed = _post(tier, plan, files, targets)
    stats["read_in_place_bytes"] = float(sum(f.in_place_bytes for f in local.values()))
    for name, pieces in incoming.items():
        files[name] = memory_fs.PiecesFile(entries[name].size, pieces, placed.get(name))
    dirname = checkpoint_dirname(cand.step)
    listed = {f"{dirname}/{name}": local.get(name, f) for name, f in files.items()}
    listed[f"{dirname}/{DCP_METADATA_NAME}"] = memory_fs.BytesFile(raw)
    listed[f"{dirname}/{MANIFEST_NAME}"] = memory_fs.BytesFile(cand.manifest_bytes)
    listed[f"{dirname}/{COMPLETE_NAME}"] = memory_fs.BytesFile(cand.commit_bytes)
    for name, entry in entries.items():  # unread files: present, sized, never read
        listed.setdefault(f"{dirname}/{name}", memory_fs.PiecesFile(entry.size, []))
    key = f"r{tier.rank}-p{os.getpid()}-{uuid.uuid4().hex[:8]}"
    pieces = [p for ps in incoming.values() for p in ps]
    restore = Restore(key, memory_fs.register(key, listed), sender, pieces, stats)
    tier.last_restore = restore.stats  # completed by release()
    return restore


def _post(
    tier: MemoryTier,
    plan: list[tuple[str, int, int, list[tuple[int, int, int | None]]]],
    files: dict[str, memory_fs.SnapshotFile],
    targets: dict[str, dict[int, torch.Tensor]],
) -> tuple[
    dict[str, list[memory_fs.Arriving]], _Sender | None, dict[str, float], dict[str, dict[int, Any]]
]:
    """Post this rank's part of ``plan`` over the replication group, in chunks.

    Each transfer is a list of segments ``(start, end, item)``: ``item`` set, the values
    of the tensor item at that offset, received straight into this rank's destination
    tensor (``targets``); otherwise received into a new buffer (headers, anything else).
    Sends go straight from the page cache (this node's read-only maps in ``files``),
    posted by a :class:`_Sender` once every receive is. Every rank numbers the chunks
    alike (the tags). Returns the arriving pieces per file, the sender (None: nothing to
    send), counts for :class:`Restore`'s ``stats`` and, per file, the items received in
    place (item offset -> ``(offset, bytes)`` of their values).
    """
    incoming: dict[str, list[memory_fs.Arriving]] = {}
    placed: dict[str, dict[int, Any]] = {}
    sends: list[tuple[torch.Tensor, int, int]] = []
    stats = {"received_bytes": 0.0, "sent_bytes": 0.0, "chunks": 0.0, "placed_bytes": 0.0}
    tag = 0
    try:
        for name, src, dst, segments in plan:
            if tier.rank not in (src, dst):
                tag += sum(len(range(a, b, CHUNK_BYTES)) for a, b, _ in segments)
                continue
            for start, end, item in segments:
                piece = None
                if dst == tier.rank:
                    if item is not None:
                        target = targets[name][item]
                        buf = target.reshape(-1).view(torch.uint8)
                        placed.setdefault(name, {})[item] = (start, end - start)
                        stats["placed_bytes"] += end - start
                    else:
                        buf = torch.empty(end - start, dtype=torch.uint8)
                    piece = memory_fs.Arriving(start, buf, f"{name} from rank {src}")
                    incoming.setdefault(name, []).append(piece)
                    stats["received_bytes"] += end - start
                else:
                    stats["sent_bytes"] += end - start
                    mapped = files[name]
                    assert isinstance(mapped, memory_fs.MappedFile)
                for first in range(start, end, CHUNK_BYTES):
                    last = min(end, first + CHUNK_BYTES)
                    tag += 1
                    stats["chunks"] += 1
                    if piece is not None:
                        part = piece.buf[first - start : last - start]
                        work = dist.irecv(part, src=src, group=tier.repl_group, tag=tag)
                        piece.add(first, last, work)
                    else:
                        sends.append((mapped.tensor(first, last), dst, tag))
    except BaseException:
        for pieces in incoming.values():
            for piece in pieces:
                piece.settle()
        raise
    sender = _Sender(tier.repl_group, sends) if sends else None
    return incoming, sender, stats, placed


class _Sender:
    """This rank's sends of a restore, posted in order from a thread of its own.

    Why a thread: gloo writes a send into its socket in the calling thread while the
    socket takes it (only what is left goes to gloo's own thread). When the receiving
    rank drains as fast as that, posting every send from the loading thread can make it
    copy all the shipped bytes before its own load starts, a restore slower by that copy
    in some runs; posted from a thread of their own, the sends leave the loading thread
    free from the start. A send's buffer is read by gloo until :meth:`settle` has waited
    for it.
    """

    def __init__(self, group: Any, sends: list[tuple[torch.Tensor, int, int]]) -> None:
        self._group = group
        self._todo = sends
        self._works: list[Any] = []
        self._error: str | None = None
        self._thread = threading.Thread(target=self._post, name="ckptmem-send", daemon=True)
        self._thread.start()

    def _post(self) -> None:
        try:
            for data, dst, tag in self._todo:
                self._works.append(dist.isend(data, dst=dst, group=self._group, tag=tag))
        except Exception as exc:  # the peer went away: its load fails on its side
            self._error = f"{type(exc).__name__}: {exc}"

    def settle(self) -> str | None:
        """Wait until every send is posted and done; the first error, if any."""
        self._thread.join()
        error = _settle(self._works)
        error, self._error = self._error or error, None
        self._works, self._todo = [], []
        return error


def _local_reads(
    files: dict[str, memory_fs.SnapshotFile],
    wanted: dict[str, list[tuple[int, int]]],
    whole: dict[str, dict[int, torch.Tensor]],
    metadata: Any,
) -> dict[str, memory_fs.LocalFile]:
    """For each file on this node that holds items this rank loads whole into their own
    memory: a :class:`~ckpt.tiers.memory.fs.LocalFile` copying those items' values from its map
    straight into it (where its node's copy keeps them as that memory's bytes, as a shipped
    item's, :func:`_segments`)."""
    lengths = {(i.relative_path, i.offset): i.length for i in metadata.storage_data.values()}
    out: dict[str, memory_fs.LocalFile] = {}
    for name, per in whole.items():
        mapped = files.get(name)
        if not per or name not in wanted or not isinstance(mapped, memory_fs.MappedFile):
            continue
        layouts: dict[int, Any] = {}
        for off in sorted(per):
            length = lengths.get((name, off))
            if length is not None and off + length <= mapped.size:
                found = data_layout(mapped.read(off, off + length))
                if found is not None:
                    layouts[off] = found
        shapes = {off: _shape_of(t) for off, t in per.items()}
        cut = _segments(wanted[name], shapes, layouts, metadata, name)
        into = [(start, end, item) for start, end, item in cut if item is not None]
        if into:
            out[name] = memory_fs.LocalFile(
                mapped,
                [
                    (start, end, per[item].reshape(-1).view(torch.uint8))
                    for start, end, item in into
                ],
                {item: (start, end - start) for start, end, item in into},
            )
    return out


def _layouts(
    coll: Collective,
    tier: MemoryTier,
    reports: list[dict[str, Any]],
    files: dict[str, memory_fs.SnapshotFile],
    metadata: Any,
) -> list[dict[str, dict[int, Any]]]:
    """Per rank: where the values of each requested item lie inside it, as its node's
    copy says (``tensorblob.data_layout``; node readers only, one gather, skipped when no
    rank asked for an item in place)."""
    wanted: dict[str, set[int]] = {}
    for report in reports:
        for name, per in report["direct"].items():
            wanted.setdefault(name, set()).update(per)
    if not wanted:
        return [{} for _ in reports]
    lengths = {(i.relative_path, i.offset): i.length for i in metadata.storage_data.values()}
    mine: dict[str, dict[int, Any]] = {}
    if tier.is_node_reader:
        for name, offsets in wanted.items():
            mapped = files.get(name)
            if not isinstance(mapped, memory_fs.MappedFile):
                continue
            for off in sorted(offsets):
                length = lengths.get((name, off))
                if length is None or off + length > mapped.size:
                    continue
                found = data_layout(mapped.read(off, off + length))
                if found is not None:
                    mine.setdefault(name, {})[off] = found
    return coll.all_gather(mine)


def _segments(
    spans: list[tuple[int, int]],
    direct: dict[int, Any],
    layouts: dict[int, Any],
    metadata: Any,
    name: str,
) -> list[tuple[int, int, int | None]]:
    """``spans`` cut so that the values of each item the receiver takes in place are a
    segment of their own (``(start, end, item offset)``); the rest ``(start, end, None)``.
    An item goes in place only where the sender's layout of it matches the receiver's
    destination (bytes, dtype, shape). The same on every rank: both ends of a transfer
    number its chunks alike."""
    lengths = {
        i.offset: i.length for i in metadata.storage_data.values() if i.relative_path == name
    }
    cuts: list[tuple[int, int, int]] = []
    for off, want in direct.items():
        found = layouts.get(off)
        if found is None or tuple(found[1:]) != tuple(want):
            continue
        cuts.append((off + found[0], off + found[0] + found[1], off))
    cuts.sort()
    out: list[tuple[int, int, int | None]] = []
    for start, end in spans:
        at = start
        for lo, hi, off in cuts:
            if start <= off and off + lengths.get(off, 0) <= end and at <= lo:
                if at < lo:
                    out.append((at, lo, None))
                out.append((lo, hi, off))
                at = hi
        if at < end:
            out.append((at, end, None))
    return out


def _shape_of(tensor: torch.Tensor) -> tuple[int, str, tuple[int, ...]]:
    return tensor.numel() * tensor.element_size(), str(tensor.dtype), tuple(tensor.shape)


def _settle(works: list[Any]) -> str | None:
    """Wait for every work once; the first error, if any."""
    error = None
    for work in works:
        try:
            work.wait()
        except Exception as exc:  # the peer went away: its load fails on its side
            error = error or f"{type(exc).__name__}: {exc}"
    return error


def _offer(
    rank: int, cand: Candidate, entries: dict[str, Any], verify: bool, *, with_metadata: bool
) -> dict[str, Any]:
    """This node's copy of each file (checked with ``verify``), and why others were refused;
    ``with_metadata``: also the bytes of its ``.metadata`` (every rank needs them)."""
    good: dict[str, str] = {}
    bad: list[tuple[str, str]] = []
    for name, entry in entries.items():
        for reader, path, size in cand.copies.get(name, []):
            if reader != rank or size != entry.size:
                continue
            if not verify:
                good[name] = path
                break
            try:
                actual = _file_crc32c(path)
            except OSError as exc:
                bad.append((name, f"{path}: {exc}"))
                continue
            if actual == entry.crc32c:
                good[name] = path
                break
            bad.append((name, f"{path}: crc32c {actual}, manifest says {entry.crc32c}"))
    offer: dict[str, Any] = {"good": good, "bad": bad}
    if with_metadata and DCP_METADATA_NAME in good:
        try:
            offer["metadata"] = _read_whole(good[DCP_METADATA_NAME])
        except OSError:  # the others read it from the next node that has it
            pass
    return offer


def _plan_reads(
    template: dict[str, Any], metadata: Any
) -> tuple[dict[str, list[tuple[int, int]]], dict[str, dict[int, torch.Tensor]]]:
    """What loading ``template`` reads (DCP's own local plan): the byte ranges of each
    file, merged where they touch (the loader reads spans of adjacent items, which then
    lie inside one range); and, per file, the items this rank loads whole into one
    contiguous CPU tensor of the stored dtype and shape (item offset -> that tensor: the
    memory the load writes them to, which can receive them directly)."""
    planner = SafeLoadPlanner()
    planner.set_up_planner(template, metadata, False)
    spans: dict[str, list[tuple[int, int]]] = {}
    whole: dict[str, dict[int, torch.Tensor | None]] = {}
    for item in planner.create_local_plan().items:
        info = metadata.storage_data[item.storage_index]
        spans.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
        per = whole.setdefault(info.relative_path, {})
        per[info.offset] = None if info.offset in per else _whole_target(planner, item, metadata)
    merged: dict[str, list[tuple[int, int]]] = {}
    for name, ranges in spans.items():
        out: list[tuple[int, int]] = []
        for start, end in sorted(ranges):
            if out and start <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], end))
            else:
                out.append((start, end))
        merged[name] = out
    # Two items into the same memory (tied weights) are loaded as usual: a receive must
    # never write where another item's check may be reading.
    spans_of = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n, o)
        for n, per in whole.items()
        for o, t in per.items()
        if t is not None
    )
    shared: set[tuple[str, int]] = set()
    active: list[tuple[int, str, int]] = []  # (end, file, item) of spans still open
    for lo, hi, n, o in spans_of:
        active = [a for a in active if a[0] > lo]
        if active:  # each open span starts at or before lo and ends after it: overlap
            shared.update({(n, o)} | {(a[1], a[2]) for a in active})
        active.append((hi, n, o))
    usable = {
        n: {o: t for o, t in per.items() if t is not None and (n, o) not in shared}
        for n, per in whole.items()
    }
    return merged, usable


def _whole_target(planner: Any, item: Any, metadata: Any) -> torch.Tensor | None:
    """The destination of ``item`` if it takes the whole stored chunk into one contiguous
    CPU tensor of the stored dtype and shape; else None."""
    if item.type == LoadItemType.BYTE_IO:
        return None
    stored = metadata.state_dict_metadata.get(item.dest_index.fqn)
    if not isinstance(stored, TensorStorageMetadata):
        return None
    offsets = list(item.storage_index.offset or [])
    chunk = next((c for c in stored.chunks if list(c.offsets) == offsets), None)
    if chunk is None or any(item.storage_offsets) or list(item.lengths) != list(chunk.sizes):
        return None
    target = planner.resolve_tensor(item).detach()
    if (
        target.device.type != "cpu"
        or not target.is_contiguous()
        or list(target.shape) != list(chunk.sizes)
        or target.dtype != stored.properties.dtype
        or target.numel() == 0
    ):
        return None
    return target


def _read_whole(path: str) -> bytes:
    return read_private(path)


def _file_crc32c(path: str) -> str:
    with os.fdopen(open_private(path), "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return crc32c_of(b"")
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as view:
            return crc32c_of(view)


def prune(tier: MemoryTier, keep: Candidate | None) -> None:
    """Keep only snapshot ``keep`` on every node (collective: ends with a barrier)."""
    kept = keep
    coll = Collective(tier.group)
    coll.all_gather(None)  # every rank is done reading before anything is removed
    if tier.is_node_reader:
        for holder in _listdir(tier.run_dir):
            path = os.path.join(tier.run_dir, holder)
            if not (holder.startswith("h") and holder[1:].isdigit()):
                continue
            for i in range(SLOTS):
                slot_dir = os.path.join(path, f"slot{i}")
                loaded = read_commit(slot_dir)
                if (
                    isinstance(loaded, str)
                    or keep is None
                    or loaded[0].attempt.save_id != keep.save_id
                ):
                    remove_slot(slot_dir)
    coll.all_gather(None)
    tier.pruned(None if kept is None else kept.step)


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []
