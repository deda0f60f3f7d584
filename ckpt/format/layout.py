"""Names and URL arithmetic of the checkpoint layout (the contract in docs/design.md).

    <root>/checkpoint_0000100/{.metadata, rank_00000.distcp, ..., manifest.json, COMPLETE}

Paths are plain strings joined with ``/`` so that ``gs://`` and ``memory://`` URLs
survive untouched (``pathlib`` would mangle them).
"""

from __future__ import annotations

import re

CHECKPOINT_PREFIX = "checkpoint_"
STEP_DIGITS = 7
MANIFEST_NAME = "manifest.json"
COMPLETE_NAME = "COMPLETE"
QUARANTINE_MARKER_NAME = "QUARANTINED"
"""Written into a checkpoint set aside by resume (:mod:`ckpt.root.quarantine`), before COMPLETE goes."""
DCP_METADATA_NAME = ".metadata"
SHARD_SUFFIX = ".distcp"
ATTEMPT_NAME = "ATTEMPT"
"""Written by a save's coordinator before any shard: which run and attempt the directory
belongs to (JSON), so that only a dead attempt's leftovers are ever cleared."""

PROBE_PREFIX = ".probe-"
"""Name prefix of a root check's write probe (:mod:`ckpt.root.root_check`), removed at once."""
LEASE_NAME = "OWNER"
"""The root's owner lease (:mod:`ckpt.root.lease`): one object ``OWNER`` on an object store;
records ``OWNER.<generation>`` (10 digits) on a local filesystem, published from
``.OWNER.tmp-*`` files. Never a checkpoint, never deleted by retention or ``gc``."""
LEASE_TMP_PREFIX = ".OWNER.tmp-"
LEASE_RECORD_RE = re.compile(r"^OWNER\.(\d{10,40})$")
"""A local lease record: ``OWNER.<generation>``, 10 digits or more (a generation past
9,999,999,999 has more)."""

_CHECKPOINT_DIR_RE = re.compile(r"^checkpoint_(\d{7,})$")
_SHARD_RE = re.compile(r"^rank_\d{5,}\.distcp$")
_STOCK_SHARD_RE = re.compile(r"^__\d+_\d+\.distcp$")
STOCK_DCP_DIR_RE = re.compile(r"^step-(\d+)$")
"""torchtitan's checkpoint directories (``step-30``), written by stock ``dcp.save``."""
STOCK_DCP_REASON = (
    "a stock DCP checkpoint (.metadata and __0_0.distcp files, no manifest.json or "
    "COMPLETE: written by torch.distributed.checkpoint.save, not by this library): never "
    "resumed or deleted; to continue from it, make it one of ours with `python -m ckpt "
    "import DIR ROOT` (docs/adoption.md)"
)


def is_stock_dcp(names: object) -> bool:
    """Whether the file names of a directory are those of a stock ``dcp.save`` (its
    ``__<rank>_<n>.distcp`` shards and ``.metadata``, none of our records)."""
    names = set(names)  # type: ignore[call-overload]
    return (
        DCP_METADATA_NAME in names
        and MANIFEST_NAME not in names
        and COMPLETE_NAME not in names
        and any(isinstance(n, str) and _STOCK_SHARD_RE.match(n) for n in names)
    )


def checkpoint_dirname(step: int) -> str:
    """Directory name of the checkpoint of ``step``: ``checkpoint_0000100``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{CHECKPOINT_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_checkpoint_dirname(name: str) -> int | None:
    """The step of a checkpoint directory name, or None if ``name`` is not one."""
    match = _CHECKPOINT_DIR_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def shard_filename(rank: int) -> str:
    """File holding the shards written by ``rank``: ``rank_00000.distcp``."""
    return f"rank_{rank:05d}{SHARD_SUFFIX}"


def is_shard_filename(name: str) -> bool:
    """Whether ``name`` is a shard file's name (``rank_00000.distcp``)."""
    return _SHARD_RE.match(name) is not None


def join_url(base: str, *parts: str) -> str:
    """Join URL segments with single slashes, keeping the scheme of ``base`` intact."""
    out = base.rstrip("/") if base not in ("/", "") else base
    for part in parts:
        part = part.strip("/")
        if part:
            out = f"{out}/{part}" if out not in ("", "/") else f"{out}{part}"
    return out


def is_lease_name(name: str) -> bool:
    """Whether ``name`` (an entry directly under a root) belongs to the owner lease."""
    return (
        name == LEASE_NAME
        or LEASE_RECORD_RE.match(name) is not None
        or name.startswith(LEASE_TMP_PREFIX)
    )
