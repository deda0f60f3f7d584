"""DCP ``.metadata``: decoded as data, never as code, and checked against the manifest.

``.metadata`` is a pickle (DCP's format, kept so that plain ``dcp.load`` reads our
checkpoints). A pickle names the callables that rebuild it; a crafted one can name
``os.system``. :func:`decode_metadata` therefore builds objects from an exact list of
``(module, name)`` pairs: DCP's metadata dataclasses, ``torch.Size``, torch dtypes and
layouts, and a few plain containers. A dotted name (which protocol 4 resolves by
walking attributes: ``torch.distributed.checkpoint.metadata`` + ``os.system`` through
a module attribute) is never looked up; extension codes, persistent ids and every
other global are refused, so no opcode (``GLOBAL``, ``STACK_GLOBAL``, ``INST``,
``OBJ``, ``REDUCE``, ``EXT*``) can reach a callable outside the list.

:func:`check_metadata` then treats the decoded object as untrusted input: every
field has the type DCP gives it, every storage item lies inside a shard file the
manifest lists (a plain file name, so never outside the checkpoint directory), within
that file's size, and has a crc32c in the manifest. What passes cannot make a reader
open another file, allocate more than the file holds, or use unchecked bytes.
"""

from __future__ import annotations

import collections
import io
import itertools
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt.errors import CorruptCheckpointError
from ckpt.format.layout import DCP_METADATA_NAME
from ckpt.format.manifest import Manifest

MAX_METADATA_BYTES = 1 << 30
"""A ``.metadata`` above this is refused before it is read (50k tensors take ~10 MB)."""
MAX_TENSOR_DIMS = 64
MAX_ITEM_OVERHEAD = 64 << 10
"""Bytes a tensor item may hold beyond its data: torch.save's zip records and pickle
(about 1.5 KB measured, whatever the tensor's size). A stored length past declared bytes
plus this is refused: the declared shape is tied to the bytes, both ways."""

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[tuple[str, str], Any] = {
    (_DCP_METADATA, "Metadata"): Metadata,
    (_DCP_METADATA, "StorageMeta"): StorageMeta,
    (_DCP_METADATA, "TensorProperties"): TensorProperties,
    (_DCP_METADATA, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP_METADATA, "BytesStorageMetadata"): BytesStorageMetadata,
    (_DCP_METADATA, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_DCP_METADATA, "MetadataIndex"): MetadataIndex,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): collections.OrderedDict,
    # dcp.FileSystemWriter records its checkpoint_id as a path (3.13 moved the class).
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib._local", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib._local", "PurePosixPath"): pathlib.PurePosixPath,
}
# TensorProperties pickles its memory format as this enum.
_ALLOWED[(_DCP_METADATA, "_MEM_FORMAT_ENCODING")] = _MEM_FORMAT_ENCODING
_ENUMS = frozenset({_MEM_FORMAT_ENCODING})
"""Enums whose members may be named in a pickle: Python 3.11.0 to 3.11.3 (Debian 12's
python3.11 is 3.11.2) pickle a member as ``getattr(EnumClass, "NAME")``, later ones as
``EnumClass(value)``; both are read."""
_DTYPES = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: Any) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout``: a name to a layout, nothing else."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return _LAYOUTS[name]


def _enum_member(cls: Any, name: Any) -> Any:
    """Stands in for ``builtins.getattr``: a member of an enum of :data:`_ENUMS` by its
    name, nothing else (no other class, no attribute that is not a member)."""
    if cls not in _ENUMS or not isinstance(name, str) or name not in cls.__members__:
        raise pickle.UnpicklingError(
            f"it asks for attribute {name!r} of {cls!r}, which is no member of an enum of "
            "DCP metadata"
        )
    return cls[name]


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the objects of :data:`_ALLOWED`, torch dtypes and layouts, and the
    members of :data:`_ENUMS` by name."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        raise pickle.UnpicklingError(
            f"it refers to {module}.{name}, which is not part of DCP metadata"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id, which DCP metadata never does")


def decode_metadata(raw: bytes | memoryview, *, url: str = "") -> Metadata:
    """Decode ``.metadata`` bytes into a :class:`Metadata` without running code from them.

    Raises :class:`~ckpt.errors.CorruptCheckpointError` naming the file for anything
    that is not plain DCP metadata.
    """
    if len(raw) > MAX_METADATA_BYTES:
        raise _bad(url, f"{len(raw)} bytes, more than the {MAX_METADATA_BYTES} allowed")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except (RecursionError, MemoryError) as exc:
        raise _bad(
            url, f"cannot decode ({type(exc).__name__}: nested or sized beyond reason)"
        ) from None
    except Exception as exc:  # any decoding failure of untrusted bytes is the file's fault
        raise _bad(
            url, f"cannot decode: {type(exc).__name__}: {exc}; refusing to load it"
        ) from None
    if not isinstance(metadata, Metadata):
        raise _bad(url, f"decodes to {type(metadata).__name__}, not DCP metadata")
    return metadata


def check_metadata(metadata: Metadata, manifest: Manifest, *, url: str = "") -> None:
    """Check decoded ``metadata`` against the checkpoint's ``manifest`` (module docstring).

    Raises :class:`~ckpt.errors.CorruptCheckpointError` naming the first problem.
    """
    sdm = check_state_items(metadata, url=url)
    sizes = {e.path: e.size for e in manifest.files}
    chunks = manifest.item_chunks()
    crcs = {(path, offset): length for path, items in chunks.items() for offset, length, _ in items}
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise _bad(url, "storage_data is not a dict")
    listed = sum(len(items) for items in chunks.values())
    if listed != len(crcs) or listed > len(storage):
        # Entries that back no item cost memory on every read of the manifest and check
        # nothing: each one is an item's, once.
        raise _bad(
            url,
            f"manifest.json lists {listed} item checksums ({len(crcs)} distinct places) for "
            f"the {len(storage)} items .metadata stores: each entry is one item's",
        )
    extents: dict[str, list[tuple[int, int, str]]] = {}
    chunk_bytes: dict[str, dict[tuple[int, ...], int]] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise _bad(url, f"a storage key is a {type(index).__name__}, not a MetadataIndex")
        if index.fqn not in sdm:
            raise _bad(url, f"storage item of {index.fqn!r}, which the state does not list")
        if not isinstance(info, _StorageInfo):
            raise _bad(url, f"storage item of {index.fqn!r} is a {type(info).__name__}")
        path, offset, length = info.relative_path, info.offset, info.length
        if not isinstance(path, str) or path not in sizes or path == DCP_METADATA_NAME:
            raise _bad(
                url,
                f"storage item of {index.fqn!r} is in {path!r}, which is not a shard file "
                "listed in manifest.json",
            )
        if not (_count(offset) and _count(length)) or offset + length > sizes[path]:
            raise _bad(
                url,
                f"storage item of {index.fqn!r} claims bytes [{offset!r}, +{length!r}) of "
                f"{path}, which holds {sizes[path]} bytes",
            )
        if crcs.get((path, offset)) != length:
            raise _bad(
                url,
                f"storage item of {index.fqn!r} ({path} at {offset}) has no crc32c of its "
                "length in manifest.json: its bytes could not be checked",
            )
        if info.transform_descriptors:
            raise _bad(url, f"storage item of {index.fqn!r} asks for transforms, never written")
        extents.setdefault(path, []).append((offset, length, index.fqn))
        md = sdm[index.fqn]
        if isinstance(md, TensorStorageMetadata):
            declared = _declared_bytes(md, index, chunk_bytes)
            if declared is None:
                raise _bad(url, f"storage item of {index.fqn!r} at {index.offset} is no chunk of it")
            if declared > length:
                raise _bad(
                    url,
                    f"tensor item {index.fqn!r} at {list(index.offset or ())} declares "
                    f"{declared} bytes of data but is stored in {length}: a tensor is stored "
                    "dense (a strided or repeated one would be expanded on load)",
                )
            if length > declared + MAX_ITEM_OVERHEAD:
                raise _bad(
                    url,
                    f"tensor item {index.fqn!r} at {list(index.offset or ())} declares "
                    f"{declared} bytes of data but is stored in {length}: more than an item's "
                    f"{MAX_ITEM_OVERHEAD} bytes of records beside its data",
                )
    for path, items in extents.items():
        items.sort()
        for (start, length, fqn), (next_start, _, next_fqn) in itertools.pairwise(items):
            if start + length > next_start:
                raise _bad(
                    url,
                    f"storage items of {fqn!r} and {next_fqn!r} share bytes of {path} (at "
                    f"{next_start}): each stored byte backs one item",
                )
    planner = metadata.planner_data
    if planner is not None and not (
        isinstance(planner, dict)
        and all(
            isinstance(k, str)
            and isinstance(v, tuple | list)
            and all(isinstance(p, str | int) for p in v)
            for k, v in planner.items()
        )
    ):
        raise _bad(url, "planner_data is not a map of state keys to key paths")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        raise _bad(url, "storage_meta is not DCP's StorageMeta")


def check_state_items(metadata: Metadata, *, url: str = "") -> dict[str, Any]:
    """Decoded ``metadata``'s state keys and what it says of each (a tensor: a dtype, a
    shape and chunks inside it; else bytes), checked as data; its ``state_dict_metadata``.
    Raises :class:`~ckpt.errors.CorruptCheckpointError` naming the first problem."""
    sdm = metadata.state_dict_metadata
    if not isinstance(sdm, dict):
        raise _bad(url, "state_dict_metadata is not a dict")
    for fqn, md in sdm.items():
        if not isinstance(fqn, str):
            raise _bad(url, f"a state key is a {type(fqn).__name__}, not a str")
        if isinstance(md, TensorStorageMetadata):
            _check_tensor(fqn, md, url)
        elif not isinstance(md, BytesStorageMetadata):
            raise _bad(url, f"{fqn!r} is described by a {type(md).__name__}")
    if not isinstance(metadata.storage_data, dict):
        raise _bad(url, "storage_data is not a dict")
    return sdm


def _check_tensor(fqn: str, md: TensorStorageMetadata, url: str) -> None:
    props = md.properties
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
        raise _bad(url, f"tensor {fqn!r} has no dtype")
    if not _shape(md.size):
        raise _bad(url, f"tensor {fqn!r} has an invalid shape {md.size!r}")
    if not isinstance(md.chunks, list):
        raise _bad(url, f"tensor {fqn!r} has no chunk list")
    for chunk in md.chunks:
        if (
            not isinstance(chunk, ChunkStorageMetadata)
            or not _shape(chunk.offsets)
            or not _shape(chunk.sizes)
            or not len(chunk.offsets) == len(chunk.sizes) == len(md.size)
            or any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, md.size))
        ):
            raise _bad(url, f"tensor {fqn!r} has a chunk outside its shape {list(md.size)}")


def _declared_bytes(
    md: TensorStorageMetadata, index: MetadataIndex, cache: dict[str, dict[tuple[int, ...], int]]
) -> int | None:
    """Bytes of dense data the chunk at ``index.offset`` declares (None: no such chunk).
    ``cache`` holds each tensor's chunks by offsets, built once per tensor."""
    by_offsets = cache.get(index.fqn)
    if by_offsets is None:
        by_offsets = cache[index.fqn] = {}
        for chunk in md.chunks:
            numel = 1
            for n in chunk.sizes:
                numel *= n
            by_offsets.setdefault(tuple(chunk.offsets), numel * md.properties.dtype.itemsize)
    if index.offset is None:
        return next(iter(by_offsets.values()), None)
    return by_offsets.get(tuple(index.offset))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shape(value: Any) -> bool:
    return (
        isinstance(value, torch.Size)
        and len(value) <= MAX_TENSOR_DIMS
        and all(_count(d) for d in value)
    )


def _bad(url: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{url}/{DCP_METADATA_NAME}: {why}", url=url, path=DCP_METADATA_NAME
    )
