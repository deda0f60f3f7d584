"""``manifest.json`` and ``COMPLETE``: what a checkpoint holds, and the proof it was committed.

Both are JSON (nothing in a checkpoint needs pickle). The manifest lists every
other file of the checkpoint with its size and crc32c; the COMPLETE marker names
the step, the attempt that committed it and the crc32c of the exact bytes of
manifest.json, so a marker cannot vouch for a manifest it was not written for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ckpt.checksum import crc32c_of
from ckpt.errors import CorruptCheckpointError

FORMAT_VERSION = 1


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
        try:
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
                files=[
                    FileEntry(path=str(f["path"]), size=int(f["size"]), crc32c=str(f["crc32c"]))
                    for f in data["files"]
                ],
                chunks={str(k): list(v) for k, v in data.get("chunks", {}).items()},
                metadata=dict(data.get("metadata", {})),
            )
        except CorruptCheckpointError:
            raise
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
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
            data = json.loads(raw.decode("utf-8"))
            return cls(
                step=int(data["step"]),
                attempt=Attempt.from_json(data["attempt"]),
                manifest_crc32c=str(data["manifest_crc32c"]),
                committed_at=str(data.get("committed_at", "")),
            )
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise CorruptCheckpointError(
                f"{url}: COMPLETE is not a valid marker ({type(exc).__name__}: {exc})",
                url=url,
                path="COMPLETE",
            ) from exc

    def vouches_for(self, manifest_bytes: bytes) -> bool:
        """Whether this marker was written for exactly these manifest bytes."""
        return crc32c_of(manifest_bytes) == self.manifest_crc32c
