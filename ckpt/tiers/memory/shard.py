"""One rank's shard file of a memory snapshot: DCP's format, written without re-planning.

A memory snapshot (:mod:`ckpt.tiers.memory.tier`) is taken every few steps, so the fixed
costs of a save matter more than its bytes. For a small state (the tiny GPT: 140 items
per rank, under 1 MB), planning a DCP save (local plans pickled, gathered, the global
plan scattered, results gathered) and ``torch.save``'s fixed cost per item, whatever
its size, make a plain ``dcp.save`` cost nearly as much as a training step.

Here the plan is made once, collectively, exactly as a durable save plans it
(``dcp.save`` with :class:`~ckpt.saving.writer.BlockSavePlanner`), and each tensor item's
``torch.save`` bytes are kept as a template: the bytes before and after the tensor's
raw data, which depend only on its shape, dtype and stride. Later snapshots of a state
with the same structure write, for each tensor item, prefix + the tensor's current
bytes + suffix (one copy into the file, checksummed as it streams, no pickling), and
re-serialize a non-tensor item only when its value changed. Tensor items come first in
the file and non-tensor items last, so a non-tensor value whose encoding changes length
moves only the items after it. The file is what ``torch.save`` + DCP write (the only
difference: every snapshot repeats the first save's serialization id, a field torch
only logs), so the normal verified reader (:class:`~ckpt.loading.reader.ShardReader`) loads it.

Files are rewritten in place (opened without truncation, cut to size at the end), so
a snapshot reuses the pages of the file it replaces.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ckpt.dist import Collective, quiet_single_process
from ckpt.format import checksum
from ckpt.format.checksum import ChecksummingWriter, encode_crc32c
from ckpt.format.tensorblob import NotPlain, zip_records
from ckpt.saving import finite
from ckpt.saving.writer import BlockSavePlanner, ShardWriter, own_storage, zip_crc32_off

Chunk = list[Any]  # [offset, length, crc32c] of one item, as in the manifest


@dataclass(slots=True)
class _Item:
    """One item of this rank's file, in file order."""

    index: MetadataIndex
    is_bytes: bool
    write_item: Any = None
    """DCP's ``WriteItem`` (the planner resolves the current data from it)."""
    block: tuple[int, int] | None = None
    """A row block of a larger tensor (``BlockSavePlanner``): first row, rows."""
    prefix: bytes = b""
    """Tensor items: the ``torch.save`` bytes before the raw data (empty: no template)."""
    suffix: bytes = b""
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    value: Any = None
    """Non-tensor items: the value last serialized, and its bytes in ``data``."""
    data: bytes = b""


@dataclass(slots=True)
class WrittenShard:
    """What one write of a rank's shard file produced."""

    size: int
    crc32c: str
    chunks: list[Chunk]
    """``[offset, length, crc32c]`` of every item, in file order."""
    crc_value: int = 0
    item_crcs: list[int] = field(default_factory=list)
    """The same checksums as integers (fast writes only)."""
    non_finite: list[str] = field(default_factory=list)
    """Keys of the floating tensors that held NaN or inf (:mod:`ckpt.saving.finite`)."""


@dataclass(slots=True)
class ShardLayout:
    """A planned snapshot layout: this rank's items and the global DCP metadata."""

    fingerprint: tuple[Any, ...]
    planner: BlockSavePlanner
    filename: str
    items: list[_Item]
    metadata: Metadata
    order: dict[str, list[MetadataIndex]]
    """Each rank's file -> the indices of its items in file order."""
    spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Each rank's file -> ``(offset, length)`` of its items as last written."""
    _metadata_bytes: bytes | None = None

    @property
    def max_items(self) -> int:
        return max((len(v) for v in self.order.values()), default=0)

    def update_spans(self, filename: str, spans: list[tuple[int, int]]) -> None:
        if self.spans.get(filename) != spans:
            self.spans[filename] = spans
            self._metadata_bytes = None

    def metadata_bytes(self) -> bytes:
        """The pickled DCP ``.metadata`` for the spans last written (cached)."""
        if self._metadata_bytes is None:
            storage: dict[MetadataIndex, _StorageInfo] = {}
            for filename in sorted(self.order):
                for index, (offset, length) in zip(
                    self.order[filename], self.spans[filename], strict=True
                ):
                    storage[index] = _StorageInfo(
                        relative_path=filename, offset=offset, length=length
                    )
            self.metadata.storage_data = storage
            self._metadata_bytes = pickle.dumps(self.metadata)
        return self._metadata_bytes


def fingerprint(flat: dict[str, Any]) -> tuple[Any, ...]:
    """The structure of a flattened state dict: keys, tensor kinds, dtypes and shapes."""
    out: list[Any] = []
    for key, value in flat.items():
        if isinstance(value, DTensor):
            out.append(
                (key, "D", value.dtype, tuple(value._local_tensor.shape), tuple(value.shape))
            )
        elif isinstance(value, torch.Tensor):
            out.append((key, "T", value.dtype, tuple(value.shape)))
        else:
            out.append((key, "O"))
    return tuple(out)


def set_up(layout: ShardLayout | None, state: dict[str, Any], is_coordinator: bool) -> bool:
    """Point ``layout``'s planner at ``state``; whether the layout still fits it."""
    if layout is None:
        return False
    layout.planner.set_up_planner(
        state_dict=state, storage_meta=None, is_coordinator=is_coordinator
    )
    return fingerprint(layout.planner.state_dict) == layout.fingerprint


def planned_write(
    state: dict[str, Any], path_of: Any, coll: Collective
) -> tuple[ShardLayout, WrittenShard]:
    """Plan collectively (``dcp.save``) and write this rank's file; every rank calls it.

    ``path_of(filename)`` is where this rank's file goes. Returns the layout to reuse
    and what was written. DCP reports a failure on any rank to every rank.
    """
    planner = BlockSavePlanner()
    writer = _TemplateWriter(path_of)
    with quiet_single_process():
        metadata = dcp.save(
            state,
            storage_writer=writer,
            planner=planner,
            process_group=coll.group,
            no_dist=not coll.distributed,
        )
    assert writer.written is not None and writer.items is not None
    order: dict[str, list[MetadataIndex]] = {}
    spans: dict[str, list[tuple[int, int]]] = {}
    assert metadata.storage_data is not None
    for index, info in sorted(
        metadata.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)
    ):
        order.setdefault(info.relative_path, []).append(index)
        spans.setdefault(info.relative_path, []).append((info.offset, info.length))
    layout = ShardLayout(
        fingerprint=fingerprint(planner.state_dict),
        planner=planner,
        filename=writer.filename,
        items=writer.items,
        metadata=metadata,
        order=order,
        spans=spans,
    )
    return layout, writer.written


def fast_write(layout: ShardLayout, path: str) -> WrittenShard | None:
    """Write this rank's file from the templates (after :func:`set_up`); None: replan.

    Local, no collectives. None when a tensor no longer fits its template (dtype,
    shape or contiguity changed): the caller plans again.
    """
    planner = layout.planner
    tensors: list[tuple[_Item, torch.Tensor]] = []
    for item in layout.items:
        if item.is_bytes:
            continue
        tensor = _current(planner, item)
        if item.prefix and (
            tensor.dtype != item.dtype
            or tuple(tensor.shape) != item.shape
            or not tensor.is_contiguous()
        ):
            return None
        tensors.append((item, tensor))
    changed = []
    for item in layout.items:
        if item.is_bytes:
            value = planner.lookup_object(item.index)
            if not _same_value(value, item.value):
                changed.append((item, value))
    slow = changed or any(not item.prefix for item, _ in tensors)
    # torch.save runs only for changed values and tensors without a template; reading
    # torch's serialization config (the crc32 switch) costs ~0.1 ms, so only then.
    with zip_crc32_off() if slow else contextlib.nullcontext():
        for item, value in changed:
            buf = io.BytesIO()
            torch.save(value, buf)
            item.value, item.data = copy.deepcopy(value), buf.getvalue()
        non_finite: list[str] = []
        with ShardFile(path) as sink:
            stream = _ItemStream(sink)
            for item, tensor in tensors:
                watch = finite.ValueWatch(tensor) if finite.scannable(tensor) else None
                if item.prefix:
                    stream.item(item.prefix, _raw_bytes(tensor), item.suffix, watch=watch)
                else:  # no template (not the plain one-storage case): torch.save it
                    buf = io.BytesIO()
                    torch.save(own_storage(tensor), buf)
                    stream.item(buf.getbuffer())
                if watch is not None and not watch.finite():
                    non_finite.append(item.index.fqn)
            for item in layout.items:
                if item.is_bytes:
                    stream.item(item.data)
            sink.finish(stream.size)
    return WrittenShard(
        size=stream.size,
        crc32c=encode_crc32c(stream.crc),
        chunks=stream.chunks,
        crc_value=stream.crc,
        item_crcs=stream.crcs,
        non_finite=non_finite,
    )


def _current(planner: BlockSavePlanner, item: _Item) -> torch.Tensor:
    """The item's tensor now: DCP's ``resolve_data`` without its per-item autograd call
    (``DTensor.to_local``) for the plain cases, which are what it does for them."""
    value = planner.state_dict.get(item.index.fqn)
    if isinstance(value, DTensor):
        tensor = value._local_tensor
    elif type(value) in (torch.Tensor, torch.nn.Parameter):
        tensor = value
    else:
        return _local(planner.resolve_data(item.write_item))
    if item.block is not None:
        tensor = tensor.narrow(0, *item.block)
    return _local(tensor)


_COMBINE_MIN_BYTES = 1 << 20


class _ItemStream:
    """Items written back to back; each item's crc32c, and the file's.

    The file's crc32c extends over small items (a C call) and combines large ones
    (no second pass over their bytes); the combining operator of a length is cached,
    since a snapshot repeats the previous one's lengths.
    """

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.size = 0
        self.crc = 0
        self.chunks: list[Chunk] = []
        self.crcs: list[int] = []

    def item(self, *parts: Any, watch: finite.ValueWatch | None = None) -> None:
        """Write one item made of ``parts``; the part ``watch`` matches (a tensor's raw
        bytes) is written, checksummed and looked at piece by piece (:mod:`ckpt.saving.finite`)."""
        crc, length = 0, 0
        views = [memoryview(part).cast("B") for part in parts]
        for view in views:
            if watch is not None and watch.matches(view):
                for offset in range(0, view.nbytes, watch.piece_bytes):
                    piece = view[offset : offset + watch.piece_bytes]
                    self.sink.write(piece)
                    crc = checksum.crc32c_extend(crc, piece)
                    watch.look(offset, piece.nbytes)
            else:
                self.sink.write(view)
                crc = checksum.crc32c_extend(crc, view)
            length += view.nbytes
        if length >= _COMBINE_MIN_BYTES:
            shift = checksum.crc32c_shift_operator(length)
            self.crc = checksum.crc32c_mulmod(shift, self.crc) ^ crc
        else:
            for view in views:
                self.crc = checksum.crc32c_extend(self.crc, view)
        self.chunks.append([self.size, length, encode_crc32c(crc)])
        self.crcs.append(crc)
        self.size += length


def _local(data: Any) -> torch.Tensor:
    tensor = data.detach() if data.requires_grad else data
    return tensor.cpu() if tensor.device.type != "cpu" else tensor


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _same_value(new: Any, old: Any) -> bool:
    if type(new) is not type(old):
        return False
    try:
        return bool(new == old)
    except Exception:  # arrays and other values without a plain truth value
        return False


class ShardFile:
    """A file rewritten in place (no truncation until the new size is known), buffered."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: Any = None

    def __enter__(self) -> ShardFile:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._file = io.BufferedWriter(io.FileIO(fd, "r+"), buffer_size=1 << 20)
        return self

    def write(self, data: Any) -> int:
        return self._file.write(data)

    def flush(self) -> None:
        pass

    def finish(self, size: int) -> None:
        self._file.flush()
        self._file.truncate(size)

    def __exit__(self, *exc: object) -> None:
        self._file.close()


class _TemplateWriter(StorageWriter):
    """The ``StorageWriter`` of a planned snapshot: writes this rank's file, keeps templates.

    ``finish`` (coordinator) only completes the metadata, which ``dcp.save`` returns to
    every rank; each holder writes ``.metadata`` itself.
    """

    def __init__(self, path_of: Any) -> None:
        super().__init__()
        self.path_of = path_of
        self.filename = ""
        self.items: list[_Item] | None = None
        self.written: WrittenShard | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    # Planning is the durable writer's, taken from it rather than written again: plans
    # pass through unchanged and rank i writes shard_filename(i), the file names every
    # reader of a checkpoint (durable or memory snapshot) expects.
    prepare_local_plan = ShardWriter.prepare_local_plan
    prepare_global_plan = ShardWriter.prepare_global_plan

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assert isinstance(planner, BlockSavePlanner)  # build() plans with one
        self.filename = str(plan.storage_data)
        ordered = sorted(plan.items, key=lambda it: it.type == WriteItemType.BYTE_IO)
        items: list[_Item] = []
        results: list[WriteResult] = []
        chunks: list[Chunk] = []
        non_finite: list[str] = []
        with zip_crc32_off(), ShardFile(self.path_of(self.filename)) as sink:
            stream = ChecksummingWriter(sink)
            for write_item in ordered:
                stream.start_segment()
                if write_item.type == WriteItemType.BYTE_IO:
                    value = planner.lookup_object(write_item.index)  # type: ignore[attr-defined]
                    buf = io.BytesIO()
                    torch.save(value, buf)
                    item = _Item(
                        write_item.index, True, value=copy.deepcopy(value), data=buf.getvalue()
                    )
                    stream.write(item.data)
                else:
                    tensor = _local(planner.resolve_data(write_item))
                    if not finite.is_finite(tensor):  # planning is rare: a pass of its own
                        non_finite.append(write_item.index.fqn)
                    item = _template(write_item.index, tensor)
                    stream.write(item.data)
                    item.data = b""
                    block = planner.block_of(write_item.index)
                    item.block = None if block is None else (block[1], block[2])
                item.write_item = write_item
                items.append(item)
                offset, length, crc = stream.segment()
                chunks.append([offset, length, crc])
                results.append(
                    WriteResult(
                        index=write_item.index,
                        size_in_bytes=length,
                        storage_data=_StorageInfo(
                            relative_path=self.filename, offset=offset, length=length
                        ),
                    )
                )
            sink.finish(stream.size)
        self.items = items
        self.written = WrittenShard(
            size=stream.size, crc32c=stream.crc32c, chunks=chunks, non_finite=non_finite
        )
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = None

    def storage_meta(self) -> Any:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def _template(index: MetadataIndex, tensor: torch.Tensor) -> _Item:
    """``torch.save`` the tensor; split the bytes around its raw data when that is possible.

    ``data`` holds the whole serialized item (written once, then dropped).
    """
    own = own_storage(tensor)
    buf = io.BytesIO()
    torch.save(own, buf)
    raw = buf.getvalue()
    item = _Item(index, False, data=raw)
    if not own.is_contiguous():
        return item
    try:
        records = zip_records(memoryview(raw))
    except NotPlain:
        return item
    data_records = [(off, size) for name, (off, size) in records.items() if "/data/" in name]
    nbytes = own.numel() * own.element_size()
    if len(data_records) != 1 or data_records[0][1] != nbytes:
        return item
    offset, size = data_records[0]
    item.prefix, item.suffix = raw[:offset], raw[offset + size :]
    item.dtype, item.shape = own.dtype, tuple(own.shape)
    if not item.prefix:  # an empty prefix would read as "no template"
        return _Item(index, False, data=raw)
    return item
