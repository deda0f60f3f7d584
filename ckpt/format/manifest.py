"""``manifest.json`` and ``COMPLETE``: what a checkpoint holds, and the proof it was committed.

Both are JSON (nothing in a checkpoint needs pickle). The manifest lists every
other file of the checkpoint with its size and crc32c; the COMPLETE marker names
the step, the attempt that committed it and the crc32c of the exact bytes of
manifest.json, so a marker cannot vouch for a manifest it was not written for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from ckpt.errors import CorruptCheckpointError
from ckpt.format.checksum import crc32c_of

FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 256 << 20
"""A manifest.json above this is refused unread (50k tensors on 8 ranks take ~20 MB)."""
MAX_MARKER_BYTES = 64 << 10
"""A COMPLETE (or memory-tier COMMIT) above this is refused unread (one is ~300 bytes)."""
_DECODE_ERRORS = (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError, MemoryError)


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is a file name in one directory: no separator, no ``.``/``..``.

    Every path a manifest lists must be one, so that nothing a checkpoint says can
    point outside its own directory.
    """
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and name not in (".", "..")
        and not any(c in name for c in "/\\\0")
    )


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")
    return value


def _file_entry(data: object) -> FileEntry:
    if not isinstance(data, dict):
        raise TypeError(f"a files entry is a {type(data).__name__}, not an object")
    if not is_plain_name(data["path"]):
        raise ValueError(f"file path {data['path']!r} is not a plain file name")
    return FileEntry(
        path=data["path"], size=_count(data["size"], "file size"), crc32c=str(data["crc32c"])
    )


def _chunks(data: object, files: list[FileEntry]) -> dict[str, list[list[Any]]]:
    if not isinstance(data, dict):
        raise TypeError("chunks is not an object")
    sizes = {e.path: e.size for e in files}
    out: dict[str, list[list[Any]]] = {}
    for path, items in data.items():
        if path not in sizes:
            raise ValueError(f"chunks of {path!r}, a file the manifest does not list")
        if not isinstance(items, list):
            raise TypeError(f"chunks of {path!r} is not a list")
        for item in items:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[2], str)):
                raise ValueError(f"a chunk of {path!r} is not [offset, length, crc32c]")
            offset = _count(item[0], "chunk offset")
            if offset + _count(item[1], "chunk length") > sizes[path]:
                raise ValueError(f"a chunk of {path!r} ends past the file's {sizes[path]} bytes")
        out[path] = items
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Attempt:
    """Who wrote a checkpoint: the run, its job-wide restart count and a per-save id.

    Fencing compares ``restart_count``: a writer of an older attempt never commits
    over a checkpoint committed by a newer one.
    """

    run_id: str
    restart_count: int
    save_id: str

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "restart_count": self.restart_count, "save_id": self.save_id}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Attempt:
        return cls(
            run_id=str(data["run_id"]),
            restart_count=int(data["restart_count"]),
            save_id=str(data["save_id"]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class FileEntry:
    """One file of a checkpoint: path relative to the checkpoint directory, size, crc32c."""

    path: str
    size: int
    crc32c: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """Content of ``manifest.json``.

    ``chunks`` maps a shard file to ``[offset, length, crc32c]`` of each item in it,
    so a rank that reads only part of a file (resharding) still verifies every byte
    it uses.
    """

    step: int
    created_at: str
    world_size: int
    attempt: Attempt
    membership: list[dict[str, Any]]
    torch_version: str
    files: list[FileEntry]
    chunks: dict[str, list[list[Any]]] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    chunks_dropped: bool = False
    """A listing's summary (:meth:`summary`): ``chunks`` left out, never read or loaded from."""

    def summary(self) -> Manifest:
        """This manifest without its per-item ``chunks``: what a listing keeps of each
        checkpoint, so that a root of many (or padded) manifests is held one at a time."""
        return replace(self, chunks={}, chunks_dropped=True)

    def item_chunks(self) -> dict[str, list[list[Any]]]:
        """``chunks`` for reading or verifying items; a summary has none to give."""
        if self.chunks_dropped:
            raise RuntimeError(
                f"the manifest of step {self.step} is a listing's summary without its chunks: "
                "read it again with Catalog.info(step) before loading or verifying"
            )
        return self.chunks

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    def file(self, path: str) -> FileEntry | None:
        for entry in self.files:
            if entry.path == path:
                return entry
        return None

    def to_bytes(self) -> bytes:
        data = {
            "format_version": self.format_version,
            "step": self.step,
            "created_at": self.created_at,
            "world_size": self.world_size,
            "run_id": self.attempt.run_id,
            "restart_count": self.attempt.restart_count,
            "attempt": self.attempt.to_json(),
            "membership": self.membership,
            "torch_version": self.torch_version,
            "files": [{"path": e.path, "size": e.size, "crc32c": e.crc32c} for e in self.files],
            "chunks": self.chunks,
            "metadata": self.metadata,
        }
        return (json.dumps(data, indent=1, sort_keys=False) + "\n").encode("utf-8")

    @classmethod
    def from_bytes(cls, raw: bytes, *, url: str = "") -> Manifest:
        """Parse and check ``manifest.json`` (untrusted: every field's type and range, plain
        file names, chunks inside their files); :class:`CorruptCheckpointError` otherwise."""
        try:
            if len(raw) > MAX_MANIFEST_BYTES:
                raise ValueError(f"{len(raw)} bytes, more than {MAX_MANIFEST_BYTES}")
            data = json.loads(raw.decode("utf-8"))
            if int(data["format_version"]) > FORMAT_VERSION:
                raise CorruptCheckpointError(
                    f"{url}: manifest format_version {data['format_version']} is newer than "
                    f"this library reads ({FORMAT_VERSION}); upgrade to load it",
                    url=url,
                )
            return cls(
                format_version=int(data["format_version"]),
                step=int(data["step"]),
                created_at=str(data["created_at"]),
                world_size=int(data["world_size"]),
                attempt=Attempt.from_json(data["attempt"]),
                membership=list(data.get("membership", [])),
                torch_version=str(data.get("torch_version", "")),
                files=(files := [_file_entry(f) for f in data["files"]]),
                chunks=_chunks(data.get("chunks", {}), files),
                metadata=dict(data.get("metadata", {})),
            )
        except CorruptCheckpointError:
            raise
        except _DECODE_ERRORS as exc:
            raise CorruptCheckpointError(
                f"{url}: manifest.json is not a valid manifest ({type(exc).__name__}: {exc})",
                url=url,
                path="manifest.json",
            ) from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class CompleteMarker:
    """Content of ``COMPLETE``: written last, the only proof that a checkpoint is committed."""

    step: int
    attempt: Attempt
    manifest_crc32c: str
    committed_at: str

    def to_bytes(self) -> bytes:
        data = {
            "step": self.step,
            "attempt": self.attempt.to_json(),
            "manifest_crc32c": self.manifest_crc32c,
            "committed_at": self.committed_at,
        }
        return (json.dumps(data, indent=1) + "\n").encode("utf-8")

    @classmethod
    def from_bytes(cls, raw: bytes, *, url: str = "") -> CompleteMarker:
        try:
            if len(raw) > MAX_MARKER_BYTES:
                raise ValueError(f"{len(raw)} bytes, more than {MAX_MARKER_BYTES}")
            data = json.loads(raw.decode("utf-8"))
            return cls(
                step=int(data["step"]),
                attempt=Attempt.from_json(data["attempt"]),
                manifest_crc32c=str(data["manifest_crc32c"]),
                committed_at=str(data.get("committed_at", "")),
            )
        except _DECODE_ERRORS as exc:
            raise CorruptCheckpointError(
                f"{url}: COMPLETE is not a valid marker ({type(exc).__name__}: {exc})",
                url=url,
                path="COMPLETE",
            ) from exc

    def vouches_for(self, manifest_bytes: bytes) -> bool:
        """Whether this marker was written for exactly these manifest bytes."""
        return crc32c_of(manifest_bytes) == self.manifest_crc32c
