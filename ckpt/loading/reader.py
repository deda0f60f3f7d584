"""Shard reader: a torch.distributed.checkpoint ``StorageReader`` over :class:`Storage`.

Resharding comes from DCP's planner; this reader only fetches bytes. It reads
with explicit byte ranges (``cat_file(path, start, end)``) under the storage
timeout, never through fsspec's prefetching file cache (which hung for good on
GCS with several ranks), coalescing neighbouring items into one request.

Every item's bytes are checked against the crc32c recorded in the manifest
before they are deserialized; a mismatch raises
:class:`~ckpt.errors.CorruptCheckpointError` naming the file and offset.

Nothing here runs code from the checkpoint: ``.metadata`` is decoded from an exact
list of DCP's metadata classes and checked against the manifest
(:mod:`ckpt.format.dcp_metadata`: every item inside a listed shard file, with a crc32c);
tensors and byte items load with ``torch.load(weights_only=True)``. An item without a
crc32c in the manifest is never used.
"""

from __future__ import annotations

import dataclasses
import io
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ckpt.errors import CorruptCheckpointError, ObjectNotFoundError, StateMismatchError
from ckpt.format.checksum import crc32c_extend, crc32c_of, encode_crc32c
from ckpt.format.dcp_metadata import MAX_METADATA_BYTES, check_metadata, decode_metadata
from ckpt.format.layout import DCP_METADATA_NAME
from ckpt.format.manifest import Manifest
from ckpt.format.tensorblob import view_tensor
from ckpt.loading import read_once
from ckpt.storage import FILE, Storage

# Coalesce neighbouring items into one ranged request up to this many bytes.
MAX_READ_SPAN_BYTES = 64 << 20
MIN_LOCAL_SPAN_BYTES = 4 << 20
LOCAL_SPANS = 8
"""A read whose storage leaves the span to the reader (local files) is cut into about
this many spans (each 4-64 MB), so that reading the next span overlaps checking and
copying the current one even for a single small shard (one 32 MB span was read, then
checked, then copied, in series)."""
OBJECT_STORE_GAP_BYTES = 1 << 20
"""On an object store, items at most this far apart are read in one ranged request,
the bytes between them included: each request costs a round trip (tens of ms on S3 and
GCS, in which more than this arrives) and, on a server that reads the whole object for
any range (moto), the whole object. Local files read exactly the items."""


def local_span_bytes(total: int) -> int:
    """The span size of a local read of ``total`` bytes (:data:`LOCAL_SPANS`)."""
    return max(MIN_LOCAL_SPAN_BYTES, min(MAX_READ_SPAN_BYTES, total // LOCAL_SPANS))


def load_metadata(raw: bytes, *, url: str = "", manifest: Manifest | None = None) -> Metadata:
    """Decode DCP ``.metadata`` bytes without running code from them
    (:mod:`ckpt.format.dcp_metadata`); with ``manifest``, also check every item against it."""
    metadata = decode_metadata(raw, url=url)
    if manifest is not None:
        check_metadata(metadata, manifest, url=url)
    return metadata


def coalesce_extents(
    extents: list[tuple[int, int]], max_bytes: int, max_gap: int = 0
) -> list[tuple[int, int, list[int]]]:
    """Group offset-sorted ``(offset, length)`` extents of one file into byte ranges to
    read with one request each: ``(start, end, indices of the extents in it)``.

    An extent joins the open range when it overlaps it or starts at most ``max_gap``
    bytes after its end, and the range stays within ``max_bytes``. Pure.
    """
    out: list[tuple[int, int, list[int]]] = []
    start = end = -1
    group: list[int] = []
    for index, (offset, length) in enumerate(extents):
        item_end = offset + length
        if group and offset <= end + max_gap and max(end, item_end) - start <= max_bytes:
            end = max(end, item_end)
            group.append(index)
            continue
        if group:
            out.append((start, end, group))
        start, end, group = offset, item_end, [index]
    if group:
        out.append((start, end, group))
    return out


class Scattered:
    """Bytes ``[start, start + len)`` of a file as consecutive parts, some of which may
    already sit in the destination: what a storage returns for a span when it received
    a tensor item's values straight into the tensor they load into
    (:mod:`ckpt.tiers.memory.restore`), so that nothing is copied twice.

    ``parts``: ``(file offset, uint8 tensor)`` in order, covering the span exactly.
    ``placed``: item offset -> ``(file offset, bytes)`` of that item's values, received
    into a destination's memory. The reader checks such an item's crc32c over its parts
    and commits it only if that part *is* the destination the load resolves (same
    address and size); anything else is joined and loaded as usual.
    """

    def __init__(
        self,
        start: int,
        parts: list[tuple[int, torch.Tensor]],
        placed: dict[int, tuple[int, int]],
    ) -> None:
        self.start = start
        self.parts = parts
        self.placed = placed
        self.nbytes = sum(t.numel() for _, t in parts)

    def __len__(self) -> int:
        return self.nbytes

    def pieces(self, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """The parts' views of file bytes ``[start, end)``, in order."""
        out = []
        for at, part in self.parts:
            lo, hi = max(start, at), min(end, at + part.numel())
            if lo < hi:
                out.append((lo, part[lo - at : hi - at]))
        return out


class ShardReader(StorageReader):
    """Reads the checkpoint rooted at ``ckpt_dir``, verified against ``manifest``.

    ``bytes_read`` counts the bytes this rank fetched.
    """

    def __init__(self, ckpt_dir: Storage, manifest: Manifest, *, collective: Any = None) -> None:
        super().__init__()
        self.ckpt_dir = ckpt_dir
        self.manifest = manifest
        self.collective = collective
        """The load's :class:`~ckpt.dist.Collective`: with one of 2+ ranks on gloo, items
        every rank loads are read once (:mod:`ckpt.loading.read_once`)."""
        self.storage_data: dict[Any, Any] = {}
        self.bytes_read = 0
        self._metadata: Metadata | None = None
        self._item_crcs = {
            (path, int(offset)): (int(length), str(crc))
            for path, items in manifest.item_chunks().items()
            for offset, length, crc in items
        }

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}
        self.bytes_read = 0

    def read_metadata(self) -> Metadata:
        if self._metadata is None:
            self._metadata = self.fetch_metadata()
        return self._metadata

    def fetch_metadata(self) -> Metadata:
        """Read, checksum and decode ``.metadata``.

        Load calls this on every rank before ``dcp.load`` (which would swallow the
        error's type and file name into a bare AssertionError).
        """
        url = self.ckpt_dir.root_url
        entry = self.manifest.file(DCP_METADATA_NAME)
        if entry is None:
            raise CorruptCheckpointError(
                f"{url}: manifest.json does not list {DCP_METADATA_NAME}: it cannot be checked",
                url=url,
                path=DCP_METADATA_NAME,
            )
        if entry.size > MAX_METADATA_BYTES:
            raise CorruptCheckpointError(
                f"{url}/{DCP_METADATA_NAME}: manifest says {entry.size} bytes, more than the "
                f"{MAX_METADATA_BYTES} a reader accepts",
                url=url,
                path=DCP_METADATA_NAME,
            )
        if self.ckpt_dir.local_kind(DCP_METADATA_NAME) not in (None, FILE):
            raise CorruptCheckpointError(
                f"{url}/{DCP_METADATA_NAME} is not a regular file (a link is never followed)",
                url=url,
                path=DCP_METADATA_NAME,
            )
        try:
            raw = self.ckpt_dir.read_bytes(DCP_METADATA_NAME, max_bytes=entry.size)
        except ObjectNotFoundError as exc:
            raise CorruptCheckpointError(
                f"{url}: {DCP_METADATA_NAME} is missing", url=url, path=DCP_METADATA_NAME
            ) from exc
        if len(raw) != entry.size or crc32c_of(raw) != entry.crc32c:
            raise CorruptCheckpointError(
                f"{url}/{DCP_METADATA_NAME}: {len(raw)} bytes with crc32c {crc32c_of(raw)}, "
                f"manifest says {entry.size} bytes with {entry.crc32c}",
                url=url,
                path=DCP_METADATA_NAME,
            )
        self.bytes_read += len(raw)
        return load_metadata(raw, url=url, manifest=self.manifest)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise CorruptCheckpointError(f"{self.ckpt_dir.root_url}: .metadata has no storage data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if not self._reads_once():
            return plans
        span_bytes, _ = self.ckpt_dir.read_pipeline()
        shared = read_once.plan_shared_reads(
            plans,
            self._extent,
            lambda extents: coalesce_extents(extents, span_bytes or MAX_READ_SPAN_BYTES),
        )
        if shared is None:
            return plans
        return [dataclasses.replace(plan, storage_data=shared) for plan in plans]

    def plans_globally(self) -> bool:
        """Whether :meth:`prepare_global_plan` changes the plans (read-once sharing), so
        that a load must exchange them (:mod:`ckpt.loading.planning`)."""
        return self._reads_once()

    def _reads_once(self) -> bool:
        coll = self.collective
        if coll is None or not read_once.usable(coll.group):
            return False
        chosen = self.ckpt_dir.options.read_once
        return chosen if chosen is not None else self.ckpt_dir.read_pipeline()[1] > 1

    def _extent(self, item: ReadItem) -> tuple[str, int, int]:
        info = self.storage_data[item.storage_index]
        return info.relative_path, info.offset, info.length

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        shared = plan.storage_data
        if not isinstance(shared, read_once.SharedReads):
            self._read_items(plan.items, planner)
        else:
            own = [i for i in plan.items if self._extent(i)[:2] not in shared.members]
            exchanged = [i for i in plan.items if self._extent(i)[:2] in shared.members]
            failed: BaseException | None = None
            try:
                self._read_items(own, planner)
            except Exception as exc:  # the exchange below still needs this rank
                failed = exc
            self.bytes_read += read_once.exchange(
                shared,
                exchanged,
                lambda item: self._extent(item)[:2],
                group=self.collective.group,
                rank=self.collective.rank,
                read_into=self.ckpt_dir.read_range_into,
                use=lambda path, start, view, items: self._use_span(
                    path, start, view, items, planner
                ),
                url=self.ckpt_dir.root_url,
                failed=failed,
            )
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_items(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        per_file: dict[str, list[ReadItem]] = {}
        for item in items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        span_bytes, depth = self.ckpt_dir.read_pipeline()
        max_gap = OBJECT_STORE_GAP_BYTES if depth > 1 else 0
        if span_bytes is None:
            total = sum(self.storage_data[it.storage_index].length for it in items)
            span_bytes = local_span_bytes(total)
        spans: list[tuple[str, int, int, list[ReadItem]]] = []
        for path, items in per_file.items():
            items.sort(key=lambda it: self.storage_data[it.storage_index].offset)
            infos = [self.storage_data[it.storage_index] for it in items]
            extents = [(info.offset, info.length) for info in infos]
            spans.extend(
                (path, start, end, [items[i] for i in members])
                for start, end, members in coalesce_extents(extents, span_bytes, max_gap)
            )
        if depth > 1:
            self._read_pipelined(spans, depth, planner)
            return
        # One span is read ahead while the previous one is verified and decoded, so
        # the disk (or network) and the CPU work overlap; at most two spans in memory.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-read-ahead") as pool:
            ahead = pool.submit(self._read_span, *spans[0][:3]) if spans else None
            for i, (path, start, _end, span_items) in enumerate(spans):
                assert ahead is not None
                data = ahead.result()
                ahead = (
                    pool.submit(self._read_span, *spans[i + 1][:3]) if i + 1 < len(spans) else None
                )
                self._use_span(path, start, data, span_items, planner)

    def _read_pipelined(
        self, spans: list[tuple[str, int, int, list[ReadItem]]], depth: int, planner: LoadPlanner
    ) -> None:
        """``depth`` spans in flight (object stores), each read into a recycled buffer.

        A buffer goes back to the free list once its span is verified and copied into
        the state (nothing keeps a view of it: tensors are copied, byte items decoded).
        """
        free: list[bytearray] = []

        def read(path: str, start: int, end: int, buf: bytearray | None) -> tuple[Any, Any]:
            if buf is None or len(buf) < end - start:
                buf = bytearray(end - start)
            view = memoryview(buf)[: end - start]
            self.ckpt_dir.read_range_into(path, start, view)
            return view, buf

        def take(n: int) -> bytearray | None:
            for i, buf in enumerate(free):
                if len(buf) >= n:
                    return free.pop(i)
            return None

        with ThreadPoolExecutor(max_workers=depth, thread_name_prefix="ckpt-read-ahead") as pool:
            pending = deque(
                pool.submit(read, *spans[i][:3], None) for i in range(min(depth, len(spans)))
            )
            for i, (path, start, _end, span_items) in enumerate(spans):
                view, buf = pending.popleft().result()
                self.bytes_read += len(view)
                self._use_span(path, start, view, span_items, planner)
                del view
                free.append(buf)
                if len(free) > depth:  # spans of growing sizes: keep the largest few
                    free.remove(min(free, key=len))
                if i + depth < len(spans):
                    nxt = spans[i + depth]
                    pending.append(pool.submit(read, *nxt[:3], take(nxt[2] - nxt[1])))

    def _read_span(self, path: str, start: int, end: int) -> bytes:
        data = self.ckpt_dir.read_range(path, start, end)
        self.bytes_read += end - start
        return data

    def _use_span(
        self, path: str, start: int, data: Any, span_items: list[ReadItem], planner: LoadPlanner
    ) -> None:
        if isinstance(data, Scattered):
            self._use_scattered(path, data, span_items, planner)
            return
        verified: set[int] = set()
        for item in span_items:
            info = self.storage_data[item.storage_index]
            # An item filling its span (the usual large tensor) is used as the
            # bytes object itself: no copy for the checksum or for BytesIO.
            whole = info.offset == start and info.length == len(data)
            piece = (
                data
                if whole
                else memoryview(data)[info.offset - start : info.offset - start + info.length]
            )
            if info.offset not in verified:
                self._verify_item(path, info.offset, piece)
                verified.add(info.offset)
            self._deliver(item, piece, planner)

    def _use_scattered(
        self, path: str, data: Scattered, span_items: list[ReadItem], planner: LoadPlanner
    ) -> None:
        verified: set[int] = set()
        for item in span_items:
            info = self.storage_data[item.storage_index]
            pieces = data.pieces(info.offset, info.offset + info.length)
            if len(pieces) == 1:  # inside one part: the usual bytes
                piece = memoryview(pieces[0][1].numpy())
                if info.offset not in verified:
                    self._verify_item(path, info.offset, piece)
                    verified.add(info.offset)
                self._deliver(item, piece, planner)
                continue
            if info.offset not in verified:
                self._verify_parts(path, info.offset, [t for _, t in pieces])
                verified.add(info.offset)
            where = data.placed.get(info.offset)
            if where is not None and item.type != LoadItemType.BYTE_IO:
                target = planner.resolve_tensor(item).detach()
                part = next((t for at, t in pieces if at == where[0]), None)
                if (
                    part is not None
                    and part.numel() == where[1] == target.numel() * target.element_size()
                    and target.is_contiguous()
                    and part.data_ptr() == target.data_ptr()
                    and (path, info.offset) in self._item_crcs
                ):
                    planner.commit_tensor(item, target)  # the values are already there
                    continue
            joined = b"".join(memoryview(t.numpy()) for _, t in pieces)
            self._deliver(item, joined, planner)

    def _expected(self, path: str, offset: int) -> tuple[int, str]:
        """The manifest's ``(length, crc32c)`` of the item at ``offset`` of ``path``; an
        item without one is never used (its bytes could not be checked)."""
        expected = self._item_crcs.get((path, offset))
        if expected is None:
            raise CorruptCheckpointError(
                f"{self.ckpt_dir.url(path)}: the item at offset {offset} has no crc32c in "
                "manifest.json; refusing to use unchecked bytes",
                url=self.ckpt_dir.root_url,
                path=path,
            )
        return expected

    def _verify_parts(self, path: str, offset: int, parts: list[torch.Tensor]) -> None:
        length, crc = self._expected(path, offset)
        value = 0
        for part in parts:
            value = crc32c_extend(value, memoryview(part.numpy()))
        actual = encode_crc32c(value)
        size = sum(p.numel() for p in parts)
        if length != size or actual != crc:
            raise CorruptCheckpointError(
                f"{self.ckpt_dir.url(path)}: bytes [{offset}, {offset + size}) have crc32c "
                f"{actual}, manifest says {crc}: the file is corrupt",
                url=self.ckpt_dir.root_url,
                path=path,
            )

    def _verify_item(self, path: str, offset: int, piece: bytes | memoryview) -> None:
        length, crc = self._expected(path, offset)
        actual = crc32c_of(piece)
        if length != len(piece) or actual != crc:
            raise CorruptCheckpointError(
                f"{self.ckpt_dir.url(path)}: bytes [{offset}, {offset + len(piece)}) have crc32c "
                f"{actual}, manifest says {crc}: the file is corrupt",
                url=self.ckpt_dir.root_url,
                path=path,
            )

    @staticmethod
    def _deliver(item: ReadItem, piece: bytes | memoryview, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(piece))
            return
        # A view of the bytes just read where the item is a plain tensor (no second
        # allocation and copy); torch.load for anything else.
        tensor = view_tensor(piece)
        if tensor is None:
            try:
                tensor = torch.load(io.BytesIO(piece), map_location="cpu", weights_only=True)
            except Exception as exc:  # untrusted bytes
                raise CorruptCheckpointError(
                    f"the saved tensor {item.dest_index.fqn!r} cannot be decoded "
                    f"({type(exc).__name__})",
                    path=item.dest_index.fqn,
                ) from None
            if not isinstance(tensor, torch.Tensor):
                raise CorruptCheckpointError(
                    f"the saved item of {item.dest_index.fqn!r} is a "
                    f"{type(tensor).__name__}, not a tensor",
                    path=item.dest_index.fqn,
                )
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise StateMismatchError(
                f"{item.dest_index.fqn}: stored chunk has shape {tuple(tensor.size())}, "
                f"destination expects {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, minus pickle, plus clear mismatch errors.

    - Byte items (Python scalars, strings) load with ``weights_only=True``
      (DefaultLoadPlanner uses ``weights_only=False``, which can run code).
    - Before anything is read, every tensor of the state to load is checked
      against the checkpoint: a missing key or another shape raises
      :class:`StateMismatchError` naming the tensor and both shapes.
    """

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            return
        stored = metadata.state_dict_metadata
        for fqn, value in self.state_dict.items():
            if fqn not in stored:
                raise StateMismatchError(
                    f"{fqn!r} is in the state to load but not in the checkpoint; "
                    "was it saved by a different model or configuration?"
                )
            if isinstance(value, torch.Tensor | DTensor):
                md = stored[fqn]
                if not isinstance(md, TensorStorageMetadata):
                    raise StateMismatchError(f"{fqn!r} is a tensor here but not in the checkpoint")
                if tuple(md.size) != tuple(value.size()):
                    raise StateMismatchError(
                        f"tensor {fqn!r} has shape {tuple(md.size)} in the checkpoint but "
                        f"{tuple(value.size())} in the model: the checkpoint was written for a "
                        "different model shape"
                    )

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:  # untrusted bytes: a decoding failure is the checkpoint's
            raise CorruptCheckpointError(
                f"the saved value of {fqn!r} cannot be decoded as plain data "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                path=fqn,
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
