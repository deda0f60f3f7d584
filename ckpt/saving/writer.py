"""Shard writer: a torch.distributed.checkpoint ``StorageWriter`` over :class:`Storage`.

Files are in DCP's own format (items written back to back with ``torch.save``,
located by ``_StorageInfo`` in ``.metadata``), so plain ``dcp.load`` reads them;
only the names differ (``rank_00000.distcp``). Each item's crc32c is computed as
it streams out (once per byte: the file's crc32c is combined from the items') and
kept for the manifest, so a rank that later reads only some
items of a file (resharding) still verifies every byte it uses.

DCP calls, on every rank: ``set_up_storage_writer``, ``prepare_local_plan``,
``write_data``; on the coordinator: ``prepare_global_plan`` and ``finish`` (which
writes ``.metadata`` after all ranks' shards are durable).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import pickle
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ckpt import env
from ckpt.defaults import process_defaults
from ckpt.format.checksum import ChecksummingWriter
from ckpt.format.layout import DCP_METADATA_NAME, shard_filename
from ckpt.format.tensorblob import NotPlain, zip_records
from ckpt.saving import finite
from ckpt.saving.planning import LruCache
from ckpt.storage import FileRecord, Storage

SAVE_BLOCK_BYTES = 8 << 20
"""Tensor shards larger than this are saved as several DCP chunks of whole rows
(``CKPT_SAVE_BLOCK_BYTES`` overrides it)."""


def save_block_bytes() -> int:
    return env.get_int(env.SAVE_BLOCK_BYTES, SAVE_BLOCK_BYTES, minimum=1)


class BlockSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with large tensor shards cut into row blocks.

    Each block is its own DCP chunk (and item in the shard file, with its own
    crc32c), so a load into another world size reads only the blocks that overlap
    its shards: with one item per shard, a rank needing a few rows of a
    neighbour's shard had to read (and checksum) all of it, since a crc32c covers
    a whole item. Blocks are row ranges along dim 0 of at most
    ``SAVE_BLOCK_BYTES`` (at least one row); smaller or 0-d tensors stay whole.
    Plain ``dcp.load`` reads such checkpoints (several chunks per tensor are
    ordinary DCP metadata).

    DCP's local plan of a state whose items are those of a save this process already
    planned (the same keys, kinds, shapes, dtypes, shardings, ``requires_grad`` and
    pinning: :func:`local_plan_signature`) is the kept one (:func:`kept_local_plans`):
    DCP works out each DTensor's shard offsets anew, ~0.1 ms per tensor.
    """

    def __init__(self, block_bytes: int | None = None) -> None:
        super().__init__()
        self.block_bytes = save_block_bytes() if block_bytes is None else block_bytes
        self._blocks: dict[MetadataIndex, tuple[MetadataIndex, int, int]] = {}

    def create_local_plan(self) -> SavePlan:
        signature = local_plan_signature(self.state_dict, self.is_coordinator)
        kept = kept_local_plans().get(signature) if signature is not None else None
        if kept is None:
            plan = super().create_local_plan()
            if signature is not None:
                kept_local_plans().put(signature, tuple(plan.items))
        else:
            plan = SavePlan(list(kept))
            if self.flatten_state_dict:
                plan = dataclasses.replace(plan, planner_data=self.mappings)
        self._blocks = {}
        items: list[WriteItem] = []
        for item in plan.items:
            items.extend(self._split(item))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def _split(self, item: WriteItem) -> list[WriteItem]:
        data = item.tensor_data
        if item.type == WriteItemType.BYTE_IO or data is None or len(data.chunk.sizes) == 0:
            return [item]
        sizes = list(data.chunk.sizes)
        row_bytes = math.prod(sizes[1:]) * data.properties.dtype.itemsize
        if sizes[0] <= 1 or row_bytes == 0 or sizes[0] * row_bytes <= self.block_bytes:
            return [item]
        rows = max(1, self.block_bytes // row_bytes)
        out = []
        for first in range(0, sizes[0], rows):
            n = min(rows, sizes[0] - first)
            offsets = torch.Size([data.chunk.offsets[0] + first, *data.chunk.offsets[1:]])
            block_sizes = torch.Size([n, *sizes[1:]])
            index = MetadataIndex(item.index.fqn, offsets)
            self._blocks[index] = (item.index, first, n)
            out.append(
                WriteItem(
                    index=index,
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=block_sizes),
                        properties=data.properties,
                        size=data.size,
                    ),
                )
            )
        return out

    def block_of(self, index: MetadataIndex) -> tuple[MetadataIndex, int, int] | None:
        """For a row block this planner cut: (the whole tensor's index, first row, rows);
        None for an item it left whole."""
        return self._blocks.get(index)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        block = self._blocks.get(write_item.index)
        if block is None:
            return super().resolve_data(write_item)
        whole_index, first, n = block
        tensor = self.lookup_object(whole_index)
        return self.transform_object(write_item, tensor.narrow(0, first, n))


def local_plan_signature(state: dict[str, Any], is_coordinator: bool) -> tuple[Any, ...] | None:
    """What DCP's default local save plan of the (flattened) ``state`` depends on, item by
    item, with this process's rank and each DTensor's mesh and coordinate in it (a mesh
    compares equal across ranks; the shard offsets do not); None when an item is of a
    kind this does not describe (a tensor neither plain nor a DTensor: planned anew).
    Meshes are described, not held: a kept signature must not keep their groups alive."""
    import torch.distributed as dist

    where = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    parts: list[Any] = [is_coordinator, where]
    meshes: dict[int, tuple[Any, ...]] = {}
    for fqn, obj in state.items():
        if isinstance(obj, DTensor):
            local = obj._local_tensor
            if type(obj) is not DTensor or type(local) is not torch.Tensor:
                return None
            mesh = obj.device_mesh
            described = meshes.get(id(mesh))
            if described is None:
                coordinate = mesh.get_coordinate()
                described = (
                    mesh.device_type,
                    tuple(mesh.mesh.shape),
                    tuple(mesh.mesh.flatten().tolist()),
                    mesh.mesh_dim_names,
                    None if coordinate is None else tuple(coordinate),
                )
                meshes[id(mesh)] = described
            parts.append((fqn, 1, obj.shape, described, obj.placements, local.dtype,
                          local.layout, obj.requires_grad, local.is_pinned()))  # fmt: skip
        elif isinstance(obj, torch.Tensor):
            if type(obj) not in (torch.Tensor, torch.nn.Parameter):
                return None  # a subclass (ShardedTensor, ...) plans its own items
            parts.append((fqn, 2, obj.shape, obj.dtype, obj.layout, obj.requires_grad,
                          obj.is_pinned()))  # fmt: skip
        elif hasattr(obj, "__create_write_items__"):
            return None
        else:
            parts.append((fqn, 3))
    return tuple(parts)


def kept_local_plans() -> LruCache[tuple[Any, ...], tuple[WriteItem, ...]]:
    """DCP's local plans of the states this process saved (a few, most recent kept; in
    :mod:`ckpt.defaults`)."""
    return process_defaults().part("local_save_plans", LruCache, per_group=True)


class ShardWriter(StorageWriter):
    """Writes one shard file per rank plus (coordinator) ``.metadata`` into ``ckpt_dir``.

    After ``dcp.save`` returns, ``records`` holds the files this rank wrote,
    ``chunks`` the ``[offset, length, crc32c]`` of every item in them and ``non_finite``
    the keys of the floating tensors that held a NaN or an infinity (:mod:`ckpt.saving.finite`).
    """

    def __init__(self, ckpt_dir: Storage) -> None:
        super().__init__()
        self.ckpt_dir = ckpt_dir
        self.save_id = uuid.uuid4().hex
        self.records: list[FileRecord] = []
        self.chunks: dict[str, list[list[Any]]] = {}
        self.non_finite: list[str] = []
        self.is_coordinator = False

    def reset(self, checkpoint_id: Any = None) -> None:
        self.records = []
        self.chunks = {}
        self.non_finite = []
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The index of a plan is the rank of its writer in the process group.
        return [
            dataclasses.replace(plan, storage_data=shard_filename(i))
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        filename = str(plan.storage_data)
        # Tensors first, then byte items (DCP's own writer puts the byte items first): a
        # Python value whose encoding changes length between saves then moves no tensor,
        # so the coordinator reuses their write results (ckpt.saving.planning).
        items = sorted(plan.items, key=lambda item: item.type == WriteItemType.BYTE_IO)
        results: list[WriteResult] = []
        chunks: list[list[Any]] = []
        non_finite: list[str] = []

        def produce(stream: ChecksummingWriter) -> None:
            results.clear()
            chunks.clear()
            non_finite.clear()
            with zip_crc32_off():  # in the thread that serializes (storage runs one per call)
                _produce_items(stream)

        def _produce_items(stream: ChecksummingWriter) -> None:
            for item in items:
                stream.start_segment()
                if not _write_item(stream, item, planner.resolve_data(item)):
                    non_finite.append(item.index.fqn)
                offset, length, crc = stream.segment()
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=length,
                        storage_data=_StorageInfo(
                            relative_path=filename, offset=offset, length=length
                        ),
                    )
                )
                chunks.append([offset, length, crc])

        if items:
            self.records.append(self.ckpt_dir.write(filename, produce, phase="shard"))
            self.chunks[filename] = list(chunks)
            self.non_finite.extend(k for k in non_finite if k not in self.non_finite)
        future: Future[list[WriteResult]] = Future()
        future.set_result(list(results))
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        record = self.ckpt_dir.write(
            DCP_METADATA_NAME, lambda stream: pickle.dump(metadata, stream), phase="metadata"
        )
        self.records.append(record)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.ckpt_dir.root_url, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


@contextlib.contextmanager
def zip_crc32_off() -> Iterator[None]:
    """Have ``torch.save`` skip the zip records' crc32 in this thread, for the block.

    ``torch.save`` computes a (slow, single-threaded) crc32 of every tensor's bytes
    for the zip format, which is most of its time on large tensors (without it the
    bytes are only copied). Our items carry crc32c, verified on every read, and
    ``torch.load`` does not check the zip crc32, so the files stay readable by plain
    ``dcp.load``. torch keeps this setting per thread, so the application's own
    ``torch.save`` calls in other threads are not affected.
    """
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


SMALL_ITEM_BYTES = 1 << 20
"""Tensors up to this size are serialized in memory and written to the stream at once.

``torch.save`` writes a tensor as ~35 small pieces (zip records and headers); streamed
one by one, each goes through the checksumming writer and the file object, so a state of
tens of thousands of small tensors makes millions of writes, a large share of its shard's
write time (bench ``curves``, many tensors; see BENCHMARKS.md). The copy into memory
costs little next to that for tensors this small."""


def _write_item(stream: ChecksummingWriter, item: WriteItem, data: Any) -> bool:
    """Write one item; whether its values are all finite (always true for non-tensors)."""
    if item.type == WriteItemType.BYTE_IO:
        stream.write(data.getbuffer())  # the view keeps its BytesIO alive
        return True
    tensor: torch.Tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = own_storage(tensor)
    if tensor.numel() * tensor.element_size() <= SMALL_ITEM_BYTES:
        stream.write(save_templates().serialize(tensor))
        return not finite.scannable(tensor) or finite.is_finite(tensor)
    keep_alive = getattr(stream, "keep_alive", None)
    if keep_alive is not None:  # gs:// sends the storage's bytes later, without a copy
        keep_alive(tensor)
    if not finite.scannable(tensor):
        torch.save(tensor, stream)
        return True
    watch = finite.ValueWatch(tensor)
    stream.watch(watch)  # the raw bytes are looked at as they are checksummed
    try:
        torch.save(tensor, stream)
    finally:
        stream.watch(None)
    return watch.finite()


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on a storage holding exactly its bytes (what ``torch.save`` writes).

    ``torch.save`` writes a tensor's whole storage: a view into a larger buffer (a
    row block of a shard, an FSDP2 shard inside its padded storage) would drag the
    rest of that buffer along. A contiguous view gets a storage *slice* (same
    memory, no copy); anything else is cloned.
    """
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if storage.nbytes() == nbytes:
        return tensor
    if not tensor.is_contiguous():
        return tensor.clone()
    start = tensor.storage_offset() * tensor.element_size()
    exact = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return exact.set_(storage[start : start + nbytes], 0, tensor.size(), tensor.stride())


class SaveTemplates:
    """``torch.save``'s bytes around a small tensor's raw data, kept by dtype, shape and
    stride (a contiguous tensor's strides differ only on dimensions of size 1).

    ``torch.save`` costs ~0.1 ms per tensor whatever its size (it pickles the tensor and
    builds a zip archive of ~7 records); at tens of thousands of small tensors per rank
    that is seconds of every save. For a plain contiguous CPU tensor the archive is the
    same bytes before and after the raw data for every tensor of its dtype and shape
    (the records' crc32 are not computed, :func:`zip_crc32_off`; the archive's
    serialization id, a field torch only logs, is that of the first tensor), so the item
    is written as prefix + the tensor's bytes + suffix. A tensor of another kind
    (quantized, conjugate or negative bit, a subclass, non-contiguous) is ``torch.save``d.
    The memory tier keeps such templates per item (:mod:`ckpt.tiers.memory.shard`); these
    are per shape, and the few shapes of a model are reused across items and saves.
    """

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._kept: OrderedDict[tuple[Any, ...], tuple[bytes, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def serialize(self, tensor: torch.Tensor) -> bytes | memoryview:
        """The bytes ``torch.save(tensor)`` writes (with the zip crc32 off), for a CPU
        tensor on a storage of exactly its bytes (:func:`own_storage`)."""
        if not _templatable(tensor):
            return _torch_save(tensor)
        key = (tensor.dtype, tuple(tensor.shape), tensor.stride())
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
        if kept is not None:
            return b"".join((kept[0], _raw_bytes(tensor), kept[1]))
        raw = _torch_save(tensor)
        # Kept only from an archive without crc32 values: one with them would carry the
        # first tensor's checksums into every later tensor's item.
        if torch.serialization.get_crc32_options():
            return raw
        split = _split_around_data(raw, tensor.numel() * tensor.element_size())
        if split is not None:
            with self._lock:
                self._kept[key] = split
                while len(self._kept) > self.size:
                    self._kept.popitem(last=False)
        return raw


def save_templates() -> SaveTemplates:
    """The shard writer's templates, shared by the saves of a process (in
    :mod:`ckpt.defaults`, made on first use)."""
    return process_defaults().part("save_templates", SaveTemplates)


def _templatable(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not tensor.requires_grad
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


def _torch_save(tensor: torch.Tensor) -> memoryview:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getbuffer()  # the view keeps its BytesIO alive


def _split_around_data(raw: memoryview, nbytes: int) -> tuple[bytes, bytes] | None:
    """The bytes before and after the one data record of ``raw``, or None when the
    archive is not that plain case."""
    try:
        records = zip_records(raw)
    except NotPlain:
        return None
    data = [(offset, size) for name, (offset, size) in records.items() if "/data/" in name]
    if len(data) != 1 or data[0][1] != nbytes or data[0][0] == 0:
        return None
    offset, size = data[0]
    return bytes(raw[:offset]), bytes(raw[offset + size :])


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
