"""Consolidated export: one checkpoint's model, as Hugging Face safetensors or one torch file.

A checkpoint holds per-rank DCP shards of model, optimizer and extras; serving,
evaluation or fine-tuning elsewhere wants one consolidated model. :func:`export`
writes the model part only (the tensors under ``<model_key>.`` in DCP's
``.metadata``), from a checkpoint of any world size, local or ``gs://``:

- ``safetensors`` (OUT is a directory): ``model.safetensors``, or, past
  ``max_shard_size``, ``model-00001-of-0000N.safetensors`` ... plus
  ``model.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map":
  {name: file}}``), the layout ``transformers``' ``from_pretrained`` and
  ``safetensors.torch.load_file`` read. Files are written here (the format is a
  JSON header and raw little-endian bytes): no runtime dependency on ``safetensors``.
- ``torch`` (OUT is a file): one ``torch.save`` of a flat ``{name: tensor}`` dict.

Hugging Face conventions (safetensors): tied parameters are stored once in a manager's
checkpoint (:mod:`ckpt.format.names`), so they are exported once, under the name
``save_pretrained`` keeps; the ``config.json`` and ``generation_config.json`` a manager
recorded for a ``transformers`` model (:mod:`ckpt.state.hf`) are written beside the weights,
unless ``config`` gives a file; with neither, a WARNING says that ``from_pretrained``
needs a config and how to give one.

Guarantees:

- Only a committed checkpoint exports: partial, quarantined or unverifiable ones
  are refused (:class:`ExportError`). Files are first checked against the
  manifest (present, sizes, and the object crc32c where the backend reports one);
  then every item is checked against its crc32c in the manifest before its bytes are
  used (the optimizer's bytes are never read). Any mismatch is
  :class:`~ckpt.errors.CorruptCheckpointError` and leaves nothing behind.
- Streaming (safetensors): the header is planned from ``.metadata`` before any
  tensor is read. A tensor stored as blocks of whole rows (FSDP2's dim-0 shards, the
  writer's 8 MiB row blocks: the usual case, any world size) is written block by block,
  never assembled; any other layout is assembled whole, written and freed. Reader
  threads stay at most :data:`READ_AHEAD_BYTES` (and half an output file) ahead of the
  writer, so peak memory is that plus one block or tensor, never the model (bench
  ``export_memory``: 0.85-0.91 of one 89 MB output file for a 1 GB checkpoint).
  The torch format is one pickle: it holds the whole model in memory.
- Atomic output: everything is written under ``OUT.tmp-XXXXXXXX`` next to OUT,
  fsynced, then renamed to OUT. An existing OUT is refused; on any error the
  temporary is removed. Output is local only: a ``gs://`` OUT is refused (export
  to a local directory, then copy it; an object store has no atomic rename of a
  directory, and a half-copied model must not look like a model).

The CLI is ``python -m ckpt export`` (:mod:`ckpt.cli`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TextIO

import fsspec
import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ckpt.errors import CorruptCheckpointError, ExportError
from ckpt.format.checksum import crc32c_of
from ckpt.format.layout import DCP_METADATA_NAME
from ckpt.format.manifest import Manifest
from ckpt.format.tensorblob import view_tensor
from ckpt.loading.reader import ShardReader
from ckpt.loading.verify import MODE_FAST, VerifyReport, verify_dir
from ckpt.root.catalog import COMMITTED, resolve
from ckpt.root.quarantine import parse_quarantined_dirname
from ckpt.state.hf import CONFIG_FILE, pretrained_files
from ckpt.state.per_rank import PATH_SEP as PER_RANK_PATH_SEP
from ckpt.state.per_rank import PER_RANK_KEY
from ckpt.storage import Storage, crc32c_of_object
from ckpt.storage.local import LocalSink
from ckpt.tiers import manager_record

logger = logging.getLogger(__name__)

FORMAT_SAFETENSORS = "safetensors"
FORMAT_TORCH = "torch"
FORMATS = (FORMAT_SAFETENSORS, FORMAT_TORCH)
DEFAULT_MAX_SHARD_SIZE = "5GB"
RANK_MEAN = "mean"
"""``rank=`` value that averages the ranks' copies of per-rank tensors."""
"""As ``transformers``' ``save_pretrained``: decimal units (5GB = 5 * 10**9 bytes)."""
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
CONFIG_NAME = CONFIG_FILE
PROGRESS_EVERY_S = 2.0

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}

_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}

Rename = Callable[[str], "str | None"] | Mapping[str, "str | None"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportResult:
    """What :func:`export` wrote."""

    checkpoint_url: str
    step: int
    out: str
    format: str
    files: list[str]
    """Files written, relative to ``out`` (a directory) or ``[basename(out)]`` (torch)."""
    tensors: int
    bytes: int
    """Bytes of tensor data written (the index's ``total_size``)."""
    dtypes: list[str]
    """The dtypes written, e.g. ``["bfloat16"]``."""
    skipped: list[str] = field(default_factory=list)
    """Non-tensor items under the model key (not representable in the output)."""
    per_rank: list[str] = field(default_factory=list)
    """Output names of tensors the checkpoint holds per rank (BatchNorm statistics...)."""
    per_rank_source: str = ""
    """Whose copy of them was written: ``"rank R"`` or ``"mean of N ranks"``."""
    unwrapped: str = ""
    """The wrapper whose names were undone (``"AveragedModel"``, ``"DDP"``), or empty."""
    bytes_read: int = 0
    """Checkpoint bytes read for the tensors (verified items; the optimizer's are never read)."""
    seconds: float = 0.0


# -- pure planning ---------------------------------------------------------------------


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"200MiB"`` -> 209_715_200, ``1024`` -> 1024."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        if match is None:
            raise ValueError(f"max_shard_size {text!r}: give bytes or a size like 5GB, 500MB, 2GiB")
        value = int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "B").upper()])
    if value <= 0:
        raise ValueError(f"max_shard_size must be > 0 bytes, got {text!r}")
    return value


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"`` / ``"fp16"`` / ``"fp32"`` (or a floating torch.dtype) -> torch.dtype; None keeps."""
    if name is None or isinstance(name, torch.dtype):
        if isinstance(name, torch.dtype) and name not in DTYPES.values():
            raise ValueError(f"dtype {name} is not one of {', '.join(DTYPES)}")
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass(slots=True)
class Chunk:
    """One stored piece of a tensor: where it sits in the tensor, and in which file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    path: str
    offset: int
    length: int
    copy: int = 0
    """Which rank's copy it belongs to, for a tensor averaged over ranks' copies."""


@dataclass(slots=True)
class TensorPlan:
    """One output tensor: its name, the stored key and dtype, the output dtype, its chunks."""

    key: str
    name: str
    shape: tuple[int, ...]
    stored_dtype: torch.dtype
    dtype: torch.dtype
    chunks: list[Chunk]
    copies: int = 1
    """More than 1: ``chunks`` hold that many ranks' copies of a per-rank tensor (each
    chunk's ``copy``), and the output is their mean."""

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.dtype.itemsize


def _model_items(metadata: Metadata, model_key: str) -> dict[str, str]:
    """``{stored key: name inside the model}`` of everything under ``model_key``."""
    out: dict[str, str] = {}
    planner = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    prefix = f"{model_key}."
    for key in metadata.state_dict_metadata:
        path = planner.get(key)
        if isinstance(path, tuple) and path:
            if path[0] == model_key and len(path) > 1:
                out[key] = ".".join(str(p) for p in path[1:])
        elif key.startswith(prefix):
            out[key] = key[len(prefix) :]
    return out


def _per_rank_items(metadata: Metadata, model_key: str) -> dict[int, dict[str, str]]:
    """``{rank: {stored key: name inside the model}}`` of the tensors under ``model_key``
    that the checkpoint holds per rank (``per_rank.rank_R.<model_key>/<name>``,
    :mod:`ckpt.state.per_rank`)."""
    out: dict[int, dict[str, str]] = {}
    planner = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    inner_prefix = f"{model_key}{PER_RANK_PATH_SEP}"
    for key in metadata.state_dict_metadata:
        path = planner.get(key)
        if isinstance(path, tuple) and len(path) == 3:
            head, rank_name, inner = (str(p) for p in path)
        else:
            parts = key.split(".", 2)
            if len(parts) != 3:
                continue
            head, rank_name, inner = parts
        match = _RANK_NAME.fullmatch(rank_name)
        if head != PER_RANK_KEY or match is None or not inner.startswith(inner_prefix):
            continue
        out.setdefault(int(match.group(1)), {})[key] = inner[len(inner_prefix) :]
    return out


_RANK_NAME = re.compile(r"rank_(\d{1,9})")
WRAPPER_PREFIX = "module."
"""The prefix DDP, DataParallel and AveragedModel put before the wrapped module's names."""
WRAPPER_BOOKKEEPING = {"n_averaged": "AveragedModel"}
"""Entries a wrapper adds beside the wrapped module's own (left out when unwrapping)."""


def wrapper_of(names: set[str]) -> tuple[str, int, set[str]]:
    """``(wrapper, prefixes, bookkeeping)`` when every name but a wrapper's bookkeeping
    starts with ``module.`` (DDP, DataParallel, AveragedModel; nested ones count each
    prefix), else ``("", 0, set())``."""
    bookkeeping = {n for n in names if n in WRAPPER_BOOKKEEPING}
    rest = names - bookkeeping
    prefixes = 0
    while rest and all(n.startswith(WRAPPER_PREFIX * (prefixes + 1)) for n in rest):
        prefixes += 1
    if prefixes == 0:
        return "", 0, set()
    kinds = sorted({WRAPPER_BOOKKEEPING[n] for n in bookkeeping}) or ["DDP"]
    return "/".join(kinds), prefixes, bookkeeping


def top_level_keys(metadata: Metadata) -> list[str]:
    """The state's top-level keys (``model``, ``optim``, ...) for error messages."""
    planner = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    keys = set()
    for key in metadata.state_dict_metadata:
        path = planner.get(key)
        keys.add(str(path[0]) if isinstance(path, tuple) and path else key.split(".", 1)[0])
    return sorted(keys)


def _renamer(rename: Rename | None) -> Callable[[str], str | None]:
    if rename is None:
        return lambda name: name
    if isinstance(rename, Mapping):
        table = dict(rename)
        return lambda name: table.get(name, name)
    if callable(rename):
        return rename
    raise TypeError(f"rename must be a callable or a dict, got {type(rename).__name__}")


def _say_unmatched(table: Mapping[str, Any], names: set[str], model_key: str, url: str) -> None:
    """WARNING naming the rename-table entries that match no item under ``model_key``."""
    unmatched = [name for name in table if name not in names]
    if not unmatched:
        return
    logger.warning(
        "ckpt export: %d rename entr%s match%s no item under %r and %s ignored: %s; check the "
        "names (`python -m ckpt inspect %s` lists them)",
        len(unmatched),
        "y" if len(unmatched) == 1 else "ies",
        "es" if len(unmatched) == 1 else "",
        model_key,
        "is" if len(unmatched) == 1 else "are",
        ", ".join(repr(n) for n in unmatched[:10]) + (" ..." if len(unmatched) > 10 else ""),
        url or "CHECKPOINT",
    )


def _chunks_of(
    key: str, md: TensorStorageMetadata, storage: Mapping[Any, Any], url: str, copy: int = 0
) -> list[Chunk]:
    """The stored chunks of item ``key``; they must cover its every element."""
    chunks = []
    covered = 0
    for chunk in md.chunks:
        info = storage.get(MetadataIndex(key, chunk.offsets))
        if info is None:
            raise CorruptCheckpointError(
                f"{url}: .metadata lists a chunk of {key!r} at {list(chunk.offsets)} but no "
                "file holds it",
                url=url,
            )
        if getattr(info, "transform_descriptors", None):
            raise ExportError(
                f"{url}: {key!r} is stored with transforms {info.transform_descriptors}, "
                "which export does not decode"
            )
        numel = 1
        for n in chunk.sizes:
            numel *= n
        covered += numel
        chunks.append(
            Chunk(
                offsets=tuple(chunk.offsets),
                sizes=tuple(chunk.sizes),
                path=info.relative_path,
                offset=int(info.offset),
                length=int(info.length),
                copy=copy,
            )
        )
    total = 1
    for n in md.size:
        total *= n
    if covered != total:
        raise CorruptCheckpointError(
            f"{url}: the chunks of {key!r} cover {covered} of its {total} elements", url=url
        )
    return chunks


@dataclass(slots=True)
class ExportPlan:
    """What :func:`plan_tensors` decided besides the tensors: skipped items, per-rank
    tensors and whose copy, the wrapper undone."""

    skipped: list[str] = field(default_factory=list)
    per_rank: list[str] = field(default_factory=list)
    per_rank_source: str = ""
    unwrapped: str = ""
    dropped: list[str] = field(default_factory=list)
    """A wrapper's bookkeeping left out (``n_averaged``)."""


def _per_rank_sources(
    per_rank: dict[int, dict[str, str]], rank: int | str, url: str
) -> tuple[dict[str, list[str]], str]:
    """``{name: [stored key per copy]}`` of the per-rank tensors to write, and whose."""
    if not per_rank:
        return {}, ""
    ranks = sorted(per_rank)
    if rank == RANK_MEAN:
        sources: dict[str, list[str]] = {}
        for r in ranks:
            for key, name in per_rank[r].items():
                sources.setdefault(name, []).append(key)
        return sources, f"mean of {len(ranks)} ranks"
    if isinstance(rank, bool) or not isinstance(rank, int) or rank not in per_rank:
        raise ExportError(
            f"{url}: rank {rank!r} has no per-rank copy; this checkpoint holds ranks "
            f"{', '.join(map(str, ranks))}: pass one of them or {RANK_MEAN!r} (--rank)"
        )
    return {name: [key] for key, name in per_rank[rank].items()}, f"rank {rank}"


def plan_tensors(
    metadata: Metadata,
    *,
    model_key: str,
    dtype: torch.dtype | None = None,
    rename: Rename | None = None,
    url: str = "",
    rank: int | str = 0,
    unwrap: bool = True,
) -> tuple[list[TensorPlan], ExportPlan]:
    """The tensors to export in stored order, and what else was decided (:class:`ExportPlan`).

    Tensors the checkpoint holds per rank (BatchNorm statistics under DDP or FSDP2) are
    written from ``rank``'s copy, or averaged over every rank's copy with ``"mean"``
    (floating tensors; others from the lowest rank). With ``unwrap``, the names of a
    wrapper's state (DDP, AveragedModel: ``module.`` before every name) lose the prefix
    and its bookkeeping (``n_averaged``) is left out, so the output loads strictly into
    the plain module. ``rename`` maps a model name (after unwrapping) to the output
    name (None drops the tensor); names it does not list stay as they are. Entries of a
    rename table that name no item of the model (a typo) are said at WARNING; a callable
    is not checked. ``dtype`` casts floating tensors only.
    """
    items = _model_items(metadata, model_key)
    per_rank = _per_rank_items(metadata, model_key)
    if not items and not per_rank:
        raise ExportError(
            f"{url}: no item under the model key {model_key!r}; this checkpoint's top-level "
            f"keys are {', '.join(top_level_keys(metadata)) or '(none)'}: pass one of them "
            "with --model-key"
        )
    decided = ExportPlan()
    per_rank_sources, decided.per_rank_source = _per_rank_sources(per_rank, rank, url)
    sources: dict[str, list[str]] = {inner: [key] for key, inner in items.items()}
    sources.update(per_rank_sources)
    if unwrap:
        wrapper, prefixes, bookkeeping = wrapper_of(set(sources))
        if prefixes:
            decided.unwrapped = wrapper
            decided.dropped = sorted(bookkeeping)
            cut = len(WRAPPER_PREFIX) * prefixes
            renamed = {}
            for inner, keys in sources.items():
                if inner not in bookkeeping:
                    renamed[inner[cut:]] = keys
            per_rank_names = {inner[cut:] for inner in per_rank_sources}
            sources = renamed
        else:
            per_rank_names = set(per_rank_sources)
    else:
        per_rank_names = set(per_rank_sources)
    name_of = _renamer(rename)
    if isinstance(rename, Mapping):
        _say_unmatched(rename, set(sources), model_key, url)
    storage = metadata.storage_data or {}
    plans: list[TensorPlan] = []
    seen: dict[str, str] = {}
    for inner, keys in sources.items():
        mds = [metadata.state_dict_metadata[key] for key in keys]
        if any(not isinstance(md, TensorStorageMetadata) for md in mds):
            decided.skipped.append(inner)
            continue
        name = name_of(inner)
        if name is None:
            continue
        if not isinstance(name, str) or not name:
            raise ExportError(f"rename gave {name!r} for {inner!r}: give a non-empty str or None")
        if name in seen:
            raise ExportError(
                f"rename maps both {seen[name]!r} and {inner!r} to {name!r}: output names must "
                "be unique"
            )
        seen[name] = inner
        md = mds[0]
        stored = md.properties.dtype
        if any(m.size != md.size or m.properties.dtype != stored for m in mds[1:]):
            raise ExportError(
                f"{url}: the ranks' copies of {inner!r} differ in shape or dtype: they cannot "
                "be averaged; pick one rank's copy (--rank)"
            )
        if len(keys) > 1 and not stored.is_floating_point:
            keys, mds = keys[:1], mds[:1]  # a count or an index: the lowest rank's copy
        out_dtype = dtype if dtype is not None and stored.is_floating_point else stored
        if out_dtype not in _SAFETENSORS_DTYPES:
            raise ExportError(
                f"{url}: tensor {keys[0]!r} has dtype {stored}, which export cannot write"
            )
        chunks = [
            chunk
            for copy, (key, item) in enumerate(zip(keys, mds))
            for chunk in _chunks_of(key, item, storage, url, copy)
        ]
        chunks.sort(key=lambda c: (c.path, c.offset))
        if inner in per_rank_names:
            decided.per_rank.append(name)
        plans.append(
            TensorPlan(
                key=keys[0],
                name=name,
                shape=tuple(md.size),
                stored_dtype=stored,
                dtype=out_dtype,
                chunks=chunks,
                copies=len(keys),
            )
        )
    if not plans:
        raise ExportError(f"{url}: nothing to export under {model_key!r} (no tensors left)")
    return plans, decided


def plan_shards(tensors: list[TensorPlan], max_shard_bytes: int) -> list[list[TensorPlan]]:
    """Split tensors in order into files of at most ``max_shard_bytes`` of data each.

    A tensor larger than the limit gets a file of its own (as ``save_pretrained`` does).
    """
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """``model.safetensors``, or ``model-00001-of-00003.safetensors`` ... for several."""
    if count == 1:
        return [SAFETENSORS_SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def safetensors_header(tensors: list[TensorPlan]) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file of ``tensors``, in order.

    Padded with spaces to a multiple of 8 bytes so that the data is aligned.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for tensor in tensors:
        header[tensor.name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [at, at + tensor.nbytes],
        }
        at += tensor.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return len(raw).to_bytes(8, "little") + raw


# -- reading -------------------------------------------------------------------------

READ_THREADS = 4
"""Concurrent ranged reads: a few in flight read a local SSD or GCS faster than one stream."""
READ_AHEAD_BYTES = 32 << 20
"""Checkpoint bytes read ahead of the writer (bounded: this is most of the export's memory),
at most half the output file size (``max_shard_size``)."""


class _ChunkSource:
    """Reads tensor chunks from one checkpoint, each verified against the manifest first.

    Called from several reader threads at once.
    """

    def __init__(self, ckpt_dir: Storage, manifest: Manifest) -> None:
        self.ckpt_dir = ckpt_dir
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._item_crcs = {
            (path, int(offset)): (int(length), str(crc))
            for path, items in manifest.item_chunks().items()
            for offset, length, crc in items
        }
        self._file_crcs = {entry.path: entry.crc32c for entry in manifest.files}
        self._files_verified: set[str] = set()

    def read(self, chunks: list[Chunk]) -> list[bytes | bytearray | memoryview]:
        """The verified bytes of ``chunks`` (neighbours in a file read in one request)."""
        out: list[bytes | bytearray | memoryview] = []
        i = 0
        while i < len(chunks):
            j = i + 1
            while (
                j < len(chunks)
                and chunks[j].path == chunks[i].path
                and chunks[j].offset == chunks[j - 1].offset + chunks[j - 1].length
            ):
                j += 1
            first, last = chunks[i], chunks[j - 1]
            span = self.ckpt_dir.read_range(first.path, first.offset, last.offset + last.length)
            with self._lock:
                self.bytes_read += len(span)
            for chunk in chunks[i:j]:
                start = chunk.offset - first.offset
                piece = span if j - i == 1 else memoryview(span)[start : start + chunk.length]
                self._verify(chunk, piece)
                out.append(piece)
            i = j
        return out

    def _verify(self, chunk: Chunk, piece: bytes | bytearray | memoryview) -> None:
        expected = self._item_crcs.get((chunk.path, chunk.offset))
        if expected is None:
            self._verify_file(chunk.path)
            return
        length, crc = expected
        actual = crc32c_of(piece)
        if length != len(piece) or actual != crc:
            raise CorruptCheckpointError(
                f"{self.ckpt_dir.url(chunk.path)}: bytes [{chunk.offset}, "
                f"{chunk.offset + len(piece)}) have crc32c {actual}, manifest says {crc}: the "
                "file is corrupt; export another checkpoint (--step)",
                url=self.ckpt_dir.root_url,
                path=chunk.path,
            )

    def _verify_file(self, path: str) -> None:
        """A manifest without per-item checksums: check the whole file once."""
        with self._lock:
            if path in self._files_verified:
                return
        expected = self._file_crcs.get(path)
        _, actual = crc32c_of_object(self.ckpt_dir, path)
        if expected is None or actual != expected:
            raise CorruptCheckpointError(
                f"{self.ckpt_dir.url(path)}: crc32c {actual}, manifest says {expected}: the "
                "file is corrupt; export another checkpoint (--step)",
                url=self.ckpt_dir.root_url,
                path=path,
            )
        with self._lock:
            self._files_verified.add(path)


def _decode(
    piece: bytes | bytearray | memoryview, chunk: Chunk, tensor: TensorPlan, url: str
) -> torch.Tensor:
    value = view_tensor(piece)
    if value is None:
        try:
            value = torch.load(io.BytesIO(piece), map_location="cpu", weights_only=True)
        except Exception as exc:  # untrusted bytes (that matched their crc32c)
            raise CorruptCheckpointError(
                f"{url}: chunk of {tensor.key!r} at {list(chunk.offsets)} cannot be decoded "
                f"({type(exc).__name__})",
                url=url,
                path=chunk.path,
            ) from None
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != chunk.sizes:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise CorruptCheckpointError(
            f"{url}: chunk of {tensor.key!r} at {list(chunk.offsets)} holds {shape}, "
            f".metadata says {list(chunk.sizes)}",
            url=url,
            path=chunk.path,
        )
    return value


def row_blocks(tensor: TensorPlan) -> list[Chunk] | None:
    """The chunks in output order when each is a block of whole rows (dim 0), else None.

    FSDP2 shards on dim 0 and ckpt's writer splits large shards into row blocks, so this
    is the usual case: the output bytes of the tensor are then the chunks' bytes one
    after the other, and the tensor is never assembled in memory.
    """
    if tensor.copies > 1:
        return None  # several ranks' copies, averaged: assembled whole
    if not tensor.shape:
        return list(tensor.chunks) if len(tensor.chunks) == 1 else None
    for chunk in tensor.chunks:
        if any(chunk.offsets[1:]) or tuple(chunk.sizes[1:]) != tensor.shape[1:]:
            return None
    ordered = sorted(tensor.chunks, key=lambda c: c.offsets[0])
    row = 0
    for chunk in ordered:
        if chunk.offsets[0] != row:
            return None
        row += chunk.sizes[0]
    return ordered if row == tensor.shape[0] else None


def units_of(tensor: TensorPlan, *, by_rows: bool) -> list[list[Chunk]]:
    """What is read and written at once: each row block apart (``by_rows``), or all chunks."""
    blocks = row_blocks(tensor) if by_rows else None
    return [[chunk] for chunk in blocks] if blocks is not None else [list(tensor.chunks)]


def assemble(
    tensor: TensorPlan,
    chunks: list[Chunk],
    pieces: list[bytes | bytearray | memoryview],
    url: str = "",
) -> torch.Tensor:
    """The output-dtype, contiguous tensor of one unit (:func:`units_of`).

    One chunk: that chunk alone (a row block, or the whole tensor), as a view of its
    bytes when no cast is needed (read-only: written out, never modified). Several: the
    full tensor, assembled.
    """
    if tensor.copies > 1:
        fulls = [torch.empty(tensor.shape, dtype=tensor.stored_dtype) for _ in range(tensor.copies)]
        for chunk, piece in zip(chunks, pieces):
            region = fulls[chunk.copy]
            for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
                region = region.narrow(dim, start, length)
            region.copy_(_decode(piece, chunk, tensor, url))
        mean = torch.stack([f.double() for f in fulls]).mean(dim=0)
        return mean.to(tensor.dtype).contiguous()
    if len(chunks) == 1:
        value = _decode(pieces[0], chunks[0], tensor, url)
        return value.to(tensor.dtype).contiguous()
    full = torch.empty(tensor.shape, dtype=tensor.dtype)
    for chunk, piece in zip(chunks, pieces):
        region = full
        for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
            region = region.narrow(dim, start, length)
        region.copy_(_decode(piece, chunk, tensor, url))
    return full


def _raw_bytes(value: torch.Tensor) -> memoryview:
    flat = value.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _stream(
    units: list[tuple[TensorPlan, list[Chunk]]],
    source: _ChunkSource,
    url: str,
    read_ahead: int = READ_AHEAD_BYTES,
) -> Iterator[torch.Tensor]:
    """Each unit's tensor, in order, while :data:`READ_THREADS` read up to ``read_ahead``
    bytes ahead (always at least the next unit)."""
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ckpt-export-read") as pool:
        pending: deque[tuple[Future[list[Any]], int]] = deque()
        ahead = submitted = 0
        for tensor, chunks in units:
            while submitted < len(units) and (not pending or ahead < read_ahead):
                size = sum(c.length for c in units[submitted][1])
                pending.append((pool.submit(source.read, units[submitted][1]), size))
                ahead += size
                submitted += 1
            future, size = pending.popleft()
            pieces = future.result()
            ahead -= size
            value = assemble(tensor, chunks, pieces, url)
            del pieces
            yield value
            del value


# -- output --------------------------------------------------------------------------


def _local_out(out: str) -> str:
    """The local path of ``out``; a remote URL is refused (see the module docstring)."""
    fs, path = fsspec.core.url_to_fs(out)
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" not in protocols and "local" not in protocols:
        raise ExportError(
            f"export writes to a local path, not {out!r}: export to a local directory, then "
            "copy it (e.g. gcloud storage cp -r OUT gs://bucket/model/); an object store has "
            "no atomic rename, and a half-copied model must not look like a whole one"
        )
    return os.path.abspath(path)


def _write_file(path: str, write: Callable[[Any], None]) -> None:
    """Write a new file through ``write(sink)``, with early writeback, and fsync it."""
    with open(path, "wb") as handle:
        write(LocalSink(handle, handle, write_behind=True))
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Progress:
    """Progress lines on a stream, at most one every :data:`PROGRESS_EVERY_S` seconds."""

    def __init__(self, stream: TextIO | None, total_tensors: int, total_bytes: int) -> None:
        self.stream = stream
        self.total_tensors, self.total_bytes = total_tensors, total_bytes
        self.tensors = self.bytes = 0
        self.started = self.last = time.monotonic()

    def add(self, nbytes: int) -> None:
        self.tensors += 1
        self.bytes += nbytes
        now = time.monotonic()
        if self.stream is None or now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        rate = self.bytes / max(now - self.started, 1e-9) / 2**20
        pct = 100.0 * self.bytes / max(self.total_bytes, 1)
        print(
            f"export: {self.tensors}/{self.total_tensors} tensors, {self.bytes / 2**20:.0f} of "
            f"{self.total_bytes / 2**20:.0f} MiB ({pct:.0f}%), {rate:.0f} MiB/s",
            file=self.stream,
            flush=True,
        )


def _write_safetensors(
    tmp: str,
    shards: list[list[TensorPlan]],
    source: _ChunkSource,
    url: str,
    progress: _Progress,
) -> list[str]:
    os.mkdir(tmp)
    names = shard_names(len(shards))
    per_tensor = [(t, units_of(t, by_rows=True)) for shard in shards for t in shard]
    largest = max(sum(t.nbytes for t in shard) for shard in shards)
    flat = [(t, unit) for t, units in per_tensor for unit in units]
    stream = _stream(flat, source, url, min(READ_AHEAD_BYTES, largest // 2))
    units_left = iter(per_tensor)
    for name, shard in zip(names, shards):

        def write(sink: Any, shard: list[TensorPlan] = shard) -> None:
            sink.write(safetensors_header(shard))
            for expected in shard:
                tensor, units = next(units_left)
                assert tensor is expected, "tensor order differs from the planned header"
                written = 0
                for _ in units:
                    value = next(stream)
                    raw = _raw_bytes(value)
                    sink.write(raw)
                    written += len(raw)
                    del raw, value
                if written != tensor.nbytes:
                    raise CorruptCheckpointError(
                        f"{url}: {tensor.key!r} gave {written} bytes, expected {tensor.nbytes}",
                        url=url,
                    )
                progress.add(tensor.nbytes)

        _write_file(os.path.join(tmp, name), write)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for s in shards for t in s)},
            "weight_map": {t.name: name for name, s in zip(names, shards) for t in s},
        }
        body = json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"
        _write_file(os.path.join(tmp, SAFETENSORS_INDEX), lambda sink: sink.write(body))
        names = [*names, SAFETENSORS_INDEX]
    return names


def _write_torch(
    tmp: str, tensors: list[TensorPlan], source: _ChunkSource, url: str, progress: _Progress
) -> None:
    state: dict[str, torch.Tensor] = {}
    stream = _stream([(t, units_of(t, by_rows=False)[0]) for t in tensors], source, url)
    for tensor, value in zip(tensors, stream):
        # A view of the read buffer would pickle the buffer's whole storage: own a copy.
        owned = value.untyped_storage().nbytes() == tensor.nbytes
        state[tensor.name] = value if owned else value.clone()
        progress.add(tensor.nbytes)
    _write_file(tmp, lambda sink: torch.save(state, sink))


# -- the operation -------------------------------------------------------------------


def _checkpoint(source: str, step: int | None) -> tuple[Storage, Any, Manifest]:
    """The committed checkpoint to export: its directory storage, info and manifest."""
    if parse_quarantined_dirname(source) is not None:
        raise ExportError(
            f"{source} is a quarantined checkpoint (set aside as damaged): export a committed "
            "one (python -m ckpt ls ROOT lists them)"
        )
    storage, info = resolve(source, step)
    if info.status != COMMITTED or info.manifest is None:
        raise ExportError(
            f"{info.url} is {info.status}, not committed ({info.reason}): export reads only "
            "committed checkpoints; python -m ckpt ls ROOT lists them, --step picks one"
        )
    return storage.child(info.dirname), info, info.manifest


def _check_files(report: VerifyReport, tensors: list[TensorPlan]) -> None:
    """Fast verification of the files the export reads; a damaged file it does not read
    (another rank's optimizer state) is said at WARNING and left out, not a refusal."""
    if report.ok:
        return
    needed = {DCP_METADATA_NAME, ""} | {c.path for t in tensors for c in t.chunks}
    if any(path in needed for path, _ in report.problems):
        report.raise_if_bad()
    logger.warning(
        "ckpt export: %s fails verification in files the model does not use (%s); the model's "
        "tensors are exported, each checked against its crc32c",
        report.url,
        "; ".join(f"{path}: {why}" for path, why in report.problems[:5]),
    )


def pretrained_side_files(
    manifest: Manifest, model_key: str, dtype: torch.dtype | None, config: str | None, out: str
) -> dict[str, bytes]:
    """The recorded ``config.json`` / ``generation_config.json`` to write next to the weights.

    A ``config`` file given by the caller replaces the recorded config. Without either,
    a WARNING says that ``from_pretrained`` needs one and how to give it.
    """
    files = pretrained_files(manager_record(manifest.metadata), model_key, dtype)
    if config is not None:
        files.pop(CONFIG_NAME, None)
    elif CONFIG_NAME not in files:
        logger.warning(
            "ckpt export: %s gets no %s: transformers' from_pretrained needs one (without it "
            "it fails with \"should have a `model_type` key\"). Export again with --config "
            "config.json (model.config.save_pretrained(DIR) writes it), or checkpoint the "
            "transformers model itself with CheckpointManager, which records its config for "
            "export",
            out, CONFIG_NAME,
        )  # fmt: skip
    return files


def _write_side_files(directory: str, files: dict[str, bytes]) -> list[str]:
    for name, body in files.items():
        _write_file(os.path.join(directory, name), lambda sink, body=body: sink.write(body))
    return sorted(files)


def load_rename_table(path: str) -> dict[str, str | None]:
    """A JSON rename table ``{"our.name": "their.name", "dropped.name": null}``."""
    try:
        with open(path, encoding="utf-8") as handle:
            table = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise ExportError(f"rename table {path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(table, dict) or not all(
        isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in table.items()
    ):
        raise ExportError(
            f"rename table {path}: give a JSON object of name -> new name (or null to drop)"
        )
    return table


def export(
    checkpoint: str,
    out: str,
    *,
    format: str = FORMAT_SAFETENSORS,
    model_key: str = "model",
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int | None = None,
    step: int | None = None,
    rename: Rename | None = None,
    config: str | None = None,
    progress: TextIO | None = None,
    rank: int | str = 0,
    unwrap: bool = True,
) -> ExportResult:
    """Write the model of one committed checkpoint as safetensors or one torch file.

    ``checkpoint`` is a root (its newest committed checkpoint, or ``step``) or one
    checkpoint directory, local or remote. ``out`` is a new local directory
    (safetensors) or file (torch). ``dtype`` (``"bf16"``, ``"fp16"``, ``"fp32"``) casts
    floating tensors; ``max_shard_size`` (safetensors, default ``"5GB"``) bounds each
    file; ``rename`` maps our names to yours (a callable or a dict; None drops a
    tensor); ``config`` is a ``config.json`` to copy next to the weights (safetensors;
    default: the one the manager recorded for a ``transformers`` model, which also
    brings its ``generation_config.json``; with neither, a WARNING).
    ``progress``: a stream for progress lines (the CLI passes stderr). ``rank``: whose
    copy of the tensors saved per rank (BatchNorm statistics) is written, or ``"mean"``
    for their average; ``unwrap``: undo a wrapper's names (DDP, AveragedModel), both said
    at WARNING (:func:`plan_tensors`). Single process; no collectives. See the module
    docstring for what is verified and the atomicity.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {format!r}")
    if format == FORMAT_TORCH and max_shard_size is not None:
        raise ValueError("max_shard_size applies to safetensors; the torch format is one file")
    if format == FORMAT_TORCH and config is not None:
        raise ValueError("config applies to safetensors (a directory); the torch format is a file")
    out_dtype = parse_dtype(dtype)
    shard_bytes = parse_size(
        max_shard_size if max_shard_size is not None else DEFAULT_MAX_SHARD_SIZE
    )
    if config is not None and not os.path.isfile(config):
        raise ExportError(f"config {config}: no such file")
    target = _local_out(out)
    if os.path.lexists(target):
        raise ExportError(
            f"{target} already exists: export writes a new path; remove it or pick another"
        )
    parent = os.path.dirname(target) or "."
    if not os.path.isdir(parent):
        raise ExportError(f"{parent} is not a directory: create it first")

    started = time.monotonic()
    ckpt_dir, info, manifest = _checkpoint(checkpoint, step)
    url = info.url
    report = verify_dir(ckpt_dir, manifest, mode=MODE_FAST)
    if any(path in (DCP_METADATA_NAME, "") for path, _ in report.problems):
        report.raise_if_bad()  # .metadata and the listing first: nothing is read past them
    metadata = ShardReader(ckpt_dir, manifest).fetch_metadata()
    tensors, decided = plan_tensors(
        metadata,
        model_key=model_key,
        dtype=out_dtype,
        rename=rename,
        url=url,
        rank=rank,
        unwrap=unwrap,
    )
    skipped = decided.skipped
    _say_decisions(decided, model_key)
    _check_files(report, tensors)
    if skipped:
        logger.warning(
            "ckpt export: %d non-tensor item(s) under %r are not exported: %s",
            len(skipped),
            model_key,
            ", ".join(skipped[:10]) + (" ..." if len(skipped) > 10 else ""),
        )
    side_files = (
        pretrained_side_files(manifest, model_key, out_dtype, config, target)
        if format == FORMAT_SAFETENSORS
        else {}
    )
    total = sum(t.nbytes for t in tensors)
    meter = _Progress(progress, len(tensors), total)
    source = _ChunkSource(ckpt_dir, manifest)
    tmp = f"{target}.tmp-{secrets.token_hex(4)}"
    try:
        if format == FORMAT_SAFETENSORS:
            files = _write_safetensors(tmp, plan_shards(tensors, shard_bytes), source, url, meter)
            if config is not None:
                shutil.copyfile(config, os.path.join(tmp, CONFIG_NAME))
                with open(os.path.join(tmp, CONFIG_NAME), "rb+") as handle:
                    os.fsync(handle.fileno())
                files.append(CONFIG_NAME)
            files.extend(_write_side_files(tmp, side_files))
            _fsync_dir(tmp)
        else:
            _write_torch(tmp, tensors, source, url, meter)
            files = [os.path.basename(target)]
        if os.path.lexists(target):
            raise ExportError(f"{target} appeared while exporting: not replacing it")
        os.rename(tmp, target)
        _fsync_dir(parent)
    except BaseException:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.lexists(tmp):
            os.remove(tmp)
        raise
    return ExportResult(
        checkpoint_url=url,
        step=info.step,
        out=target,
        format=format,
        files=files,
        tensors=len(tensors),
        bytes=total,
        dtypes=sorted({str(t.dtype).removeprefix("torch.") for t in tensors}),
        skipped=skipped,
        per_rank=decided.per_rank,
        per_rank_source=decided.per_rank_source,
        unwrapped=decided.unwrapped,
        bytes_read=source.bytes_read,
        seconds=time.monotonic() - started,
    )


def _say_decisions(decided: ExportPlan, model_key: str) -> None:
    """WARNING lines for what the output holds that is not simply the stored model."""
    if decided.per_rank:
        logger.warning(
            "ckpt export: %d tensor(s) under %r differ between ranks (saved per rank): %s; "
            "the export holds the %s (--rank R picks another rank's copy, --rank mean their "
            "average)",
            len(decided.per_rank),
            model_key,
            ", ".join(decided.per_rank[:10]) + (" ..." if len(decided.per_rank) > 10 else ""),
            f"{decided.per_rank_source}'s copy"
            if decided.per_rank_source.startswith("rank")
            else decided.per_rank_source,
        )
    if decided.unwrapped:
        logger.warning(
            "ckpt export: %r holds a wrapper's state (%s): the names lose their %r prefix%s, "
            "so the export loads into the plain module (--keep-wrapper-names keeps them)",
            model_key,
            decided.unwrapped,
            WRAPPER_PREFIX,
            f" and its bookkeeping ({', '.join(decided.dropped)}) is left out"
            if decided.dropped
            else "",
        )


def describe(result: ExportResult) -> str:
    """The summary the CLI prints: tensors, bytes, dtype, files."""
    size = result.bytes
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    lines = [
        f"exported step {result.step} of {result.checkpoint_url}",
        f"  to      {result.out} ({result.format})",
        f"  tensors {result.tensors}, {size:.1f} {unit} ({result.bytes} bytes), "
        f"dtype {', '.join(result.dtypes)}, in {result.seconds:.1f} s",
        f"  files   {', '.join(result.files)}",
    ]
    if result.skipped:
        lines.append(f"  skipped {len(result.skipped)} non-tensor item(s)")
    if result.per_rank:
        lines.append(f"  per rank {len(result.per_rank)} tensor(s) from {result.per_rank_source}")
    if result.unwrapped:
        lines.append(f"  unwrapped {result.unwrapped} names")
    return "\n".join(lines)


__all__ = [
    "DTYPES",
    "FORMATS",
    "RANK_MEAN",
    "ExportError",
    "ExportResult",
    "describe",
    "export",
    "load_rename_table",
    "parse_size",
]
