"""Files of the memory tier on a node: names, the commit record, slots (no collectives).

    <base>/<run key>/h{rank:05d}/slot{0,1}/
        rank_{R:05d}.distcp      the holder's own shard (DCP format: ckpt/memory/shard.py)
        rank_{S:05d}.distcp      replicas it received from ranks on another node
        .metadata                DCP metadata of the whole snapshot
        manifest.json            every file with size and crc32c, every item's crc32c
        COMMIT                   written last: a COMPLETE marker (step, attempt, crc32c of
                                 manifest.json); a slot without a valid one is ignored

``<base>`` is ``memory_dir``, else ``CKPT_MEMORY_DIR``, else ``/dev/shm/ckpt-memory``;
``<run key>`` is torchrun's run id plus a hash of the checkpoint root, so another launch
(a new ``--rdzv_id``) or another root never sees these snapshots.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass

from ckpt import env
from ckpt.errors import CheckpointError
from ckpt.layout import MANIFEST_NAME
from ckpt.manifest import CompleteMarker, Manifest
from ckpt.memory import shard

ENV_MEMORY_DIR = env.MEMORY_DIR
DEFAULT_MEMORY_DIR = "/dev/shm/ckpt-memory"
COMMIT_NAME = "COMMIT"
SLOTS = 2


def memory_base_dir(memory_dir: str | None = None) -> str:
    """Where memory snapshots live: ``memory_dir``, ``CKPT_MEMORY_DIR``, or /dev/shm."""
    return os.path.abspath(memory_dir or env.get_str(ENV_MEMORY_DIR, DEFAULT_MEMORY_DIR))


def run_key(run_id: str, root: str) -> str:
    """Directory name of one run's snapshots under the base: run id + hash of the root."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:64] or "run"
    return f"{safe}-{hashlib.sha1(root.encode()).hexdigest()[:10]}"


@dataclass(slots=True)
class SlotInfo:
    """A committed slot as read back from disk."""

    step: int
    save_id: str
    restart_count: int


def compact_manifest(manifest: Manifest) -> bytes:
    """``manifest.json`` without indentation: ``Manifest.to_bytes`` indents, which makes
    ``json`` use its pure-Python encoder (~3 ms for the chunks of a snapshot, every
    snapshot). The same fields; ``Manifest.from_bytes`` reads either."""
    data = json.loads(Manifest.to_bytes(_empty_like(manifest)))
    data["files"] = [{"path": e.path, "size": e.size, "crc32c": e.crc32c} for e in manifest.files]
    data["chunks"] = manifest.chunks
    data["metadata"] = manifest.metadata
    return (json.dumps(data, separators=(",", ":")) + "\n").encode("utf-8")


def _empty_like(manifest: Manifest) -> Manifest:
    return dataclasses.replace(manifest, files=[], chunks={}, metadata={})


def pick_slot(slots: list[SlotInfo | None]) -> int:
    """The slot to overwrite: never the one holding the newest committed snapshot."""
    committed = [(info.step, i) for i, info in enumerate(slots) if info is not None]
    if not committed:
        return 0
    newest = max(committed)[1]
    return (newest + 1) % SLOTS


def read_slot(slot_dir: str) -> SlotInfo | None:
    """The committed snapshot in a slot, or None (no valid COMMIT vouching for the manifest)."""
    loaded = read_commit(slot_dir)
    if isinstance(loaded, str):
        return None
    marker, _, _ = loaded
    return SlotInfo(marker.step, marker.attempt.save_id, marker.attempt.restart_count)


def read_commit(slot_dir: str) -> tuple[CompleteMarker, Manifest, bytes] | str:
    """``(marker, manifest, manifest bytes)`` of a committed slot, else why it is not one."""
    try:
        with open(os.path.join(slot_dir, COMMIT_NAME), "rb") as f:
            raw_marker = f.read()
    except OSError:
        return "no COMMIT record (snapshot interrupted or overwritten)"
    try:
        marker = CompleteMarker.from_bytes(raw_marker, url=slot_dir)
        with open(os.path.join(slot_dir, MANIFEST_NAME), "rb") as f:
            raw_manifest = f.read()
        if not marker.vouches_for(raw_manifest):
            return "COMMIT does not match manifest.json (crc32c differs)"
        manifest = Manifest.from_bytes(raw_manifest, url=slot_dir)
    except (OSError, CheckpointError) as exc:
        return f"unreadable commit record: {exc}"
    if manifest.step != marker.step:
        return f"COMMIT names step {marker.step}, manifest step {manifest.step}"
    return marker, manifest, raw_manifest


def remove_slot(slot_dir: str) -> None:
    unlink(os.path.join(slot_dir, COMMIT_NAME))  # invalid first, then gone
    shutil.rmtree(slot_dir, ignore_errors=True)


def remove_other_launches(base: str, keep: str) -> None:
    """Snapshots of the same root from an earlier launch (another run id) are unusable."""
    suffix = keep.rsplit("-", 1)[-1]
    for name in listdir(base):
        if name != keep and name.endswith(f"-{suffix}"):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def write_file(path: str, data: bytes) -> None:
    with shard.ShardFile(path) as out:
        out.write(data)
        out.finish(len(data))


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
