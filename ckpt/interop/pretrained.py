"""A Hugging Face ``save_pretrained`` directory as the starting point of a (sharded) model.

The way back from :func:`ckpt.export`: ``load_pretrained(model, "path/to/dir")`` fills a
built, possibly sharded model (FSDP2 ``fully_shard``, tensor parallel, or plain) from
``model.safetensors``, or ``model.safetensors.index.json`` and its shards, on any world
size. Every rank calls it after building and sharding its model, when
``manager.resume()`` found nothing to resume (a resume brings the trained weights back
instead); it needs no collective::

    start = manager.resume()
    if start is None:                      # a new run: start from the published weights
        ckpt.load_pretrained(model, "./Llama-tiny")
    start = start or 0

Each rank reads only its own part of each tensor: a shard of whole rows (FSDP2's dim-0
shards) is one ranged read; another placement reads the tensor and keeps its slice.
Names are the model's own, as DCP names them (no wrapper prefix), which are the names
``save_pretrained`` and :func:`ckpt.export` write. A tied parameter (``lm_head.weight``
tied to ``model.embed_tokens.weight``) needs only its stored name, and stays tied.

The files are parsed here, never executed: an 8-byte header length (bounded by
:data:`MAX_HEADER_BYTES`), a JSON header whose dtypes, shapes and offsets are checked
against the file, then raw little-endian bytes. A tensor the model has and the files
lack is a :class:`~ckpt.errors.StateMismatchError` naming it (``strict=False`` leaves
it as initialized); tensors the files hold and the model lacks, and a dtype cast (a
bf16 file into an fp32 model), are said at WARNING. Local paths and fsspec URLs
(``gs://``) work alike.

``python -m ckpt import DIR ROOT`` (:func:`import_pretrained`) makes such a directory a
committed checkpoint of ours instead: every tensor read once, in one process, and saved
with ``ckpt.save`` under ``ROOT`` as the state of one key (``model``), verified; a
manager that registers the model under that key resumes it on any world size.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateMismatchError,
    StockImportError,
)
from ckpt.format import names
from ckpt.interop.export import _SAFETENSORS_DTYPES, SAFETENSORS_INDEX, SAFETENSORS_SINGLE
from ckpt.interop.stock_dcp import PROGRESS_EVERY_S, ImportResult
from ckpt.saving.commit import save

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 100 << 20
"""A safetensors header larger than this is refused (real ones are kilobytes to a few MB)."""
_DTYPES = {code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True, slots=True)
class PretrainedLoad:
    """What :func:`load_pretrained` read into the model (on this rank)."""

    path: str
    tensors: int
    """Tensors of the model filled from the files (tied aliases not counted)."""
    bytes_read: int
    """Bytes of tensor data this rank read."""
    seconds: float
    cast: list[str] = field(default_factory=list)
    """``"name: bfloat16 -> float32"`` for each tensor cast to the model's dtype."""
    unexpected: list[str] = field(default_factory=list)
    """Tensors in the files that the model does not have (not loaded)."""
    missing: list[str] = field(default_factory=list)
    """Tensors of the model the files lack (left as initialized; only with strict=False)."""


@dataclass(frozen=True, slots=True)
class _Entry:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Offset of the tensor's first byte in the file."""


def _read_header(fs: Any, path: str) -> dict[str, _Entry]:
    """The tensors of one safetensors file: dtype, shape and absolute byte offset, checked."""
    size = fs.size(path)
    if size < 8:
        raise CorruptCheckpointError(f"{path}: {size} bytes is too short for safetensors", url=path)
    length = int.from_bytes(fs.cat_file(path, start=0, end=8), "little")
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise CorruptCheckpointError(
            f"{path}: a header of {length} bytes (file {size} bytes, at most "
            f"{MAX_HEADER_BYTES} read): not a safetensors file",
            url=path,
        )
    try:
        header = json.loads(fs.cat_file(path, start=8, end=8 + length))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path}: the header is not JSON ({exc})", url=path) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: the header is not a JSON object", url=path)
    data_start = 8 + length
    out: dict[str, _Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} has a malformed header entry {info!r} (dtype one of "
                f"{', '.join(sorted(_DTYPES))}, shape, data_offsets)",
                url=path,
            ) from None
        numel = 1
        for n in shape:
            numel *= n
        if min(shape, default=0) < 0 or end - begin != numel * dtype.itemsize or begin < 0:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r}: {end - begin} bytes for shape {list(shape)} of {dtype}",
                url=path,
            )
        if data_start + end > size:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} ends at byte {data_start + end} of a {size}-byte file",
                url=path,
            )
        out[name] = _Entry(path, dtype, shape, data_start + begin)
    return out


def _index(fs: Any, directory: str) -> dict[str, _Entry]:
    """Every tensor of a ``save_pretrained`` directory (one file or an index of shards)."""
    index_path = f"{directory.rstrip('/')}/{SAFETENSORS_INDEX}"
    single = f"{directory.rstrip('/')}/{SAFETENSORS_SINGLE}"
    if fs.exists(index_path):
        try:
            weight_map = json.loads(fs.cat_file(index_path))["weight_map"]
            files = sorted({str(f) for f in weight_map.values()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptCheckpointError(
                f"{index_path}: not a safetensors index ({exc})", url=index_path
            ) from None
        if any("/" in f or f.startswith(".") for f in files):
            raise CorruptCheckpointError(
                f"{index_path}: shard names must be files of the directory, got {files}",
                url=index_path,
            )
        paths = [f"{directory.rstrip('/')}/{f}" for f in files]
    elif fs.exists(single):
        paths = [single]
    else:
        raise CheckpointNotFoundError(
            f"{directory}: no {SAFETENSORS_SINGLE} and no {SAFETENSORS_INDEX}: give the "
            "directory save_pretrained (or python -m ckpt export) wrote"
        )
    entries: dict[str, _Entry] = {}
    for path in paths:
        entries.update(_read_header(fs, path))
    return entries


def _region(value: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's part of a model tensor."""
    if isinstance(value, DTensor):
        return compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
    return tuple(value.shape), (0,) * value.dim()


def _read_region(
    fs: Any, entry: _Entry, shape: tuple[int, ...], offset: tuple[int, ...]
) -> tuple[torch.Tensor, int]:
    """This rank's region of a stored tensor, and the bytes read for it."""
    if not entry.shape:
        count, start = 1, 0
    elif all(o == 0 for o in offset[1:]) and tuple(shape[1:]) == entry.shape[1:]:
        row = entry.dtype.itemsize
        for n in entry.shape[1:]:
            row *= n
        count, start = shape[0] * row, offset[0] * row  # whole rows: one ranged read
    else:
        count, start = None, 0
    if count is not None:
        raw = fs.cat_file(entry.file, start=entry.begin + start, end=entry.begin + start + count)
        return _decode(raw, entry.dtype, shape), len(raw)
    numel = entry.dtype.itemsize
    for n in entry.shape:
        numel *= n
    raw = fs.cat_file(entry.file, start=entry.begin, end=entry.begin + numel)
    full = _decode(raw, entry.dtype, entry.shape)
    for dim, (begin, length) in enumerate(zip(offset, shape)):
        full = full.narrow(dim, begin, length)
    return full.contiguous(), len(raw)


def _decode(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def load_pretrained(model: torch.nn.Module, path: str, *, strict: bool = True) -> PretrainedLoad:
    """Fill ``model`` from a ``save_pretrained`` directory at ``path`` (see the module docstring).

    Every rank calls it with its own part of the model; no collective. Returns what this
    rank read. Raises :class:`~ckpt.errors.CheckpointNotFoundError` when ``path`` holds
    no safetensors, :class:`~ckpt.errors.CorruptCheckpointError` for a malformed file, and
    :class:`~ckpt.errors.StateMismatchError` for a tensor of another shape, or (with
    ``strict``) one the files lack.
    """
    started = time.monotonic()
    fs, root = fsspec.core.url_to_fs(path)
    entries = _index(fs, root)
    current = get_model_state_dict(model)
    aliases = names.tied_aliases(model)
    wanted = [n for n, v in current.items() if isinstance(v, torch.Tensor)]
    missing = [n for n in wanted if n not in entries and aliases.get(n) not in entries]
    if missing and strict:
        raise StateMismatchError(
            f"{path} lacks {len(missing)} tensor(s) of the model: "
            f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}; the model's "
            f"names start {', '.join(wanted[:3])}. Load a directory saved from this "
            "architecture, or pass strict=False to leave those as initialized"
        )
    mismatched = [
        f"{n}: {list(entries[n].shape)} in the files, {list(current[n].shape)} in the model"
        for n in wanted
        if n in entries and tuple(entries[n].shape) != tuple(current[n].shape)
    ]
    if mismatched:
        raise StateMismatchError(
            f"{path} was saved from a model of other shapes: {'; '.join(mismatched[:5])}"
        )
    loaded: dict[str, Any] = {}
    cast: list[str] = []
    bytes_read = 0
    for name in wanted:
        if name not in entries:
            continue  # a tied alias (its owner is read) or, not strict, left as it is
        value = current[name]
        shape, offset = _region(value)
        local, nbytes = _read_region(fs, entries[name], shape, offset)
        bytes_read += nbytes
        if local.dtype != value.dtype:
            cast.append(f"{name}: {local.dtype} -> {value.dtype}".replace("torch.", ""))
            local = local.to(value.dtype)
        if isinstance(value, DTensor):
            local = local.to(value.to_local().device)
            loaded[name] = DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        else:
            loaded[name] = local.to(value.device)
    names.restore_aliases(loaded, aliases)
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
    unexpected = sorted(set(entries) - set(current))
    result = PretrainedLoad(
        path=path,
        tensors=sum(1 for name in loaded if name in entries),
        bytes_read=bytes_read,
        seconds=time.monotonic() - started,
        cast=cast,
        unexpected=unexpected,
        missing=missing,
    )
    _say(result)
    return result


def _say(result: PretrainedLoad) -> None:
    """The start from pretrained weights, on rank 0, at WARNING (a decision to know)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank != 0:
        return
    logger.warning(
        "rank 0: model initialized from %s (%d tensors, %.1f MiB read by rank 0, %.2f s)",
        result.path, result.tensors, result.bytes_read / 2**20, result.seconds,
    )  # fmt: skip
    if result.cast:
        logger.warning(
            "rank 0: %d tensor(s) cast to the model's dtype: %s",
            len(result.cast),
            "; ".join(result.cast[:5]) + (" ..." if len(result.cast) > 5 else ""),
        )
    for listed_names, what in (
        (result.unexpected, "tensor(s) in %s that the model does not have, not loaded"),
        (result.missing, "tensor(s) of the model are not in %s and stay as initialized"),
    ):
        if listed_names:
            listed = ", ".join(listed_names[:10]) + (" ..." if len(listed_names) > 10 else "")
            logger.warning("rank 0: %d " + what + ": %s", len(listed_names), result.path, listed)


def is_pretrained_dir(source: str) -> bool:
    """Whether ``source`` holds ``model.safetensors`` or a safetensors index."""
    fs, root = fsspec.core.url_to_fs(source)
    base = root.rstrip("/")
    return fs.exists(f"{base}/{SAFETENSORS_SINGLE}") or fs.exists(f"{base}/{SAFETENSORS_INDEX}")


def import_pretrained(
    source: str,
    root: str,
    *,
    step: int = 0,
    model_key: str = "model",
    progress: Any = None,
) -> ImportResult:
    """Save the tensors of the ``save_pretrained`` directory ``source`` as the state of
    ``model_key`` at step ``step`` of ``root`` (a committed checkpoint of ours); one
    process, no process group needed. The files are parsed as :func:`load_pretrained`
    parses them (headers checked against each file; nothing executed); ``progress``: a
    stream told how far the reading got, every few seconds (the CLI passes stderr)."""
    if not model_key:
        raise StockImportError("--model-key: give the key the manager registers the model under")
    fs, base = fsspec.core.url_to_fs(source)
    try:
        entries = _index(fs, base)
    except CheckpointNotFoundError as exc:
        raise StockImportError(str(exc)) from None
    except CorruptCheckpointError as exc:
        raise StockImportError(f"{source} is not a readable save_pretrained directory: {exc}") from None
    result = ImportResult(url="", step=step)
    tensors: dict[str, torch.Tensor] = {}
    last_said = time.monotonic()
    for name in sorted(entries):
        entry = entries[name]
        tensor, nbytes = _read_region(fs, entry, entry.shape, (0,) * len(entry.shape))
        tensors[name] = tensor
        result.tensors += 1
        result.tensor_bytes += nbytes
        if progress is not None and time.monotonic() - last_said >= PROGRESS_EVERY_S:
            last_said = time.monotonic()
            print(
                f"  read {result.tensors}/{len(entries)} tensors "
                f"({result.tensor_bytes / 2**20:.0f} MiB)",
                file=progress,
            )
    result.url = str(save({model_key: tensors}, root, step, metadata={"imported_from": source}))
    return result
