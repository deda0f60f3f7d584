"""A stock DCP checkpoint brought in as one of ours (``python -m ckpt import``).

A directory written by ``torch.distributed.checkpoint.save`` (torchtitan's ``step-N``,
or any ``.metadata`` + ``__<rank>_<n>.distcp`` directory) has no manifest, no checksums
and no COMPLETE: it is never resumed as it is (docs/design.md, *foreign*). Importing it
reads every item once, in one process, and saves the state it held with ``ckpt.save``
under a root of ours: a committed checkpoint (manifest, crc32c of every item, COMPLETE)
that verifies and loads on any world size, its keys as the stock checkpoint had them.

Its bytes are untrusted input, read as data: ``.metadata`` with the safe decoder
(:func:`~ckpt.format.dcp_metadata.decode_metadata`), each item with
``torch.load(weights_only=True)`` (stock DCP's own load uses ``weights_only=False`` for
non-tensor items); item paths must be plain files of the directory, within their sizes;
the tensors it declares may not add up to more bytes than its shard files hold (a small
directory never allocates a large state). A value that does not decode as data is left
out and named at WARNING.
"""

from __future__ import annotations

import io
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ckpt.errors import StockImportError
from ckpt.format.dcp_metadata import MAX_METADATA_BYTES, check_state_items, decode_metadata
from ckpt.format.layout import (
    DCP_METADATA_NAME,
    STOCK_DCP_DIR_RE,
    is_stock_dcp,
    parse_checkpoint_dirname,
)
from ckpt.format.manifest import is_plain_name
from ckpt.saving.commit import save
from ckpt.storage import FILE, Storage

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 5.0

__all__ = ["ImportResult", "import_stock_dcp", "step_of"]


@dataclass(slots=True)
class ImportResult:
    """What ``import_stock_dcp`` brought in."""

    url: str
    """The committed checkpoint written."""
    step: int
    tensors: int = 0
    values: int = 0
    tensor_bytes: int = 0
    left_out: dict[str, str] = field(default_factory=dict)
    """Keys of values that did not decode as data, and why."""


def step_of(source: str) -> int | None:
    """The step a stock directory's name says (``step-30``, ``checkpoint_0000030``)."""
    name = source.rstrip("/").rsplit("/", 1)[-1]
    match = STOCK_DCP_DIR_RE.match(name)
    return int(match.group(1)) if match else parse_checkpoint_dirname(name)


def import_stock_dcp(
    source: str,
    root: str,
    *,
    step: int | None = None,
    rename: dict[str, str] | None = None,
    model_key: str | None = None,
    progress: TextIO | None = None,
) -> ImportResult:
    """Save the state the stock DCP checkpoint ``source`` holds as step ``step`` (default:
    the step its name says) of ``root``; one process, no process group needed.

    ``rename``: top-level keys to rename (``{"optimizer": "optim"}``), so the checkpoint
    has the keys the manager that resumes it registers. ``model_key``: put the top-level
    tensors under this key (torchtitan saves its model's state flattened into the top
    level, beside ``optimizer`` and ``train_state``). ``progress``: a stream told
    how far the reading got, every few seconds (the CLI passes stderr).
    """
    src = Storage(source)
    listed = src.list_files()
    odd = sorted(name for name, info in listed.items() if info.get("type", FILE) != FILE)
    if odd:
        raise StockImportError(
            f"{source}: {', '.join(odd[:3])} is not a regular file (a symbolic link is never "
            "followed): not imported"
        )
    files = {name: int(info.get("size", 0)) for name, info in listed.items()}
    if not files:
        raise StockImportError(
            f"{source} is not a stock DCP checkpoint nor a save_pretrained directory: nothing "
            "is there (no such directory, or an empty one); give the directory that dcp.save "
            "or save_pretrained wrote"
        )
    if not is_stock_dcp(files):
        raise StockImportError(
            f"{source} is not a stock DCP checkpoint: it needs {DCP_METADATA_NAME} and "
            "__<rank>_<n>.distcp files and no manifest.json or COMPLETE (a checkpoint of ours "
            "needs no import); nor a save_pretrained directory (model.safetensors or "
            "model.safetensors.index.json)"
        )
    step = step if step is not None else step_of(source)
    if step is None:
        raise StockImportError(
            f"{source}: its name says no step (step-N or checkpoint_N): give the step with --step"
        )
    if files[DCP_METADATA_NAME] > MAX_METADATA_BYTES:
        raise StockImportError(f"{source}/{DCP_METADATA_NAME} is larger than {MAX_METADATA_BYTES}")
    raw = src.read_bytes(DCP_METADATA_NAME, max_bytes=MAX_METADATA_BYTES)
    metadata = decode_metadata(raw, url=src.root_url)
    check_state_items(metadata, url=src.root_url)
    flat, result = _read_items(src, metadata, files, source, progress)
    state = _nest(flat, metadata.planner_data)
    if model_key is not None:
        loose = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
        if not loose:
            raise StockImportError(f"--model-key {model_key}: {source} has no top-level tensors")
        if model_key in state:
            raise StockImportError(f"--model-key {model_key}: {source} already has that key")
        state[model_key] = {k: state.pop(k) for k in loose}
    for old, new in (rename or {}).items():
        if old not in state:
            raise StockImportError(f"--rename {old}={new}: {source} has no top-level key {old!r}")
        state[new] = state.pop(old)
    result.url = save(state, root, step, metadata={"imported_from": src.root_url})
    result.step = step
    for key, why in result.left_out.items():
        logger.warning("import: %s: %r left out: %s", source, key, why)
    return result


def _read_items(
    src: Storage, metadata: Any, files: dict[str, int], source: str, progress: TextIO | None
) -> tuple[dict[str, Any], ImportResult]:
    sdm = metadata.state_dict_metadata
    declared = sum(
        math.prod(md.size) * md.properties.dtype.itemsize
        for md in sdm.values()
        if isinstance(md, TensorStorageMetadata)
    )
    stored = sum(size for name, size in files.items() if name != DCP_METADATA_NAME)
    if declared > stored:
        raise StockImportError(
            f"{source}: its tensors declare {declared} bytes, more than the {stored} bytes "
            "its shard files hold: damaged or forged, not imported"
        )
    result = ImportResult(url="", step=-1)
    flat: dict[str, Any] = {}
    for fqn, md in sdm.items():
        if isinstance(md, TensorStorageMetadata):
            flat[fqn] = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
            result.tensors += 1
            result.tensor_bytes += flat[fqn].nbytes
    filled: dict[str, int] = {}
    ordered = sorted(
        metadata.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)
    )
    said, done = time.monotonic(), 0
    for n, (index, info) in enumerate(ordered, 1):
        path, offset, length = info.relative_path, info.offset, info.length
        if progress is not None and time.monotonic() - said > PROGRESS_EVERY_S:
            said = time.monotonic()
            print(f"  read {n - 1} of {len(ordered)} items ({done} bytes)", file=progress)
        done += length
        if not (is_plain_name(path) and path in files and path != DCP_METADATA_NAME):
            raise StockImportError(f"{source}: item {index.fqn!r} is in {path!r}, not a shard file")
        if offset < 0 or length < 0 or offset + length > files[path]:
            raise StockImportError(
                f"{source}: item {index.fqn!r} claims bytes [{offset}, +{length}) of {path}, "
                f"which holds {files[path]}"
            )
        if info.transform_descriptors:
            raise StockImportError(f"{source}: item {index.fqn!r} is stored with transforms")
        piece = bytes(src.read_range(path, offset, offset + length))
        md = sdm.get(index.fqn)
        try:
            value = torch.load(io.BytesIO(piece), map_location="cpu", weights_only=True)
        except Exception as exc:
            if isinstance(md, TensorStorageMetadata):
                raise StockImportError(
                    f"{source}: tensor {index.fqn!r} does not decode: {exc}"
                ) from exc
            result.left_out[index.fqn] = f"not plain data ({type(exc).__name__})"
            continue
        if isinstance(md, BytesStorageMetadata):
            flat[index.fqn] = value
            result.values += 1
        elif isinstance(md, TensorStorageMetadata):
            filled[index.fqn] = filled.get(index.fqn, 0) + _place(
                flat[index.fqn], index, value, source
            )
    for fqn, md in sdm.items():
        if isinstance(md, TensorStorageMetadata) and filled.get(fqn, 0) != flat[fqn].numel():
            raise StockImportError(
                f"{source}: tensor {fqn!r} has {filled.get(fqn, 0)} of its "
                f"{flat[fqn].numel()} elements stored"
            )
    return flat, result


def _place(full: torch.Tensor, index: Any, chunk: object, source: str) -> int:
    """Copy one stored chunk into its place in ``full``; its element count."""
    offsets = tuple(index.offset or (0,) * full.dim())
    if not isinstance(chunk, torch.Tensor) or len(offsets) != full.dim():
        raise StockImportError(f"{source}: item {index.fqn!r} at {offsets} is no chunk of it")
    if chunk.dtype != full.dtype or any(
        o < 0 or o + s > n for o, s, n in zip(offsets, chunk.shape, full.shape, strict=True)
    ):
        raise StockImportError(
            f"{source}: item {index.fqn!r} at {list(offsets)} ({chunk.dtype}, "
            f"{list(chunk.shape)}) does not fit {full.dtype} {list(full.shape)}"
        )
    full[tuple(slice(o, o + s) for o, s in zip(offsets, chunk.shape, strict=True))] = chunk
    return chunk.numel()


def _nest(flat: dict[str, Any], planner_data: object) -> dict[str, Any]:
    """The state as it was saved: DCP's flattened keys back into nested dicts and lists
    (``planner_data`` maps each key to its path; a key it does not name stays as is)."""
    paths = planner_data if isinstance(planner_data, dict) else {}
    root: dict[Any, Any] = {}
    for fqn, value in flat.items():
        path = paths.get(fqn, (fqn,))
        if not (
            isinstance(path, tuple | list) and path and all(isinstance(p, str | int) for p in path)
        ):
            path = (fqn,)
        node = root
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    """Dicts whose keys are the ints 0..n-1 (DCP's list positions) become lists."""
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out
