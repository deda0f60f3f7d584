"""Verification of a committed checkpoint against its manifest.

Three modes (:data:`MODES`); every one checks that each file listed in the manifest
exists as a regular file (a symbolic link is a problem, never followed) with the
manifest's size:

- ``fast``: plus, where the backend reports an object crc32c (GCS), that it equals
  the manifest's. One listing call, no download. On a backend without server-side
  checksums (local files, ``file://``, ``memory://``) this checks sizes only:
  :attr:`VerifyReport.sizes_only` counts the files whose contents nobody checked.
  ``ckpt.load`` uses this mode (it then checks every item's crc32c as it reads).
- ``checksum``: the object crc32c where the backend reports one (in the listing on
  GCS, per object on S3: one ``HeadObject`` each), otherwise reads the file in bounded
  chunks and checksums it: every file's contents are checked, with no download on GCS
  or S3. What ``python -m ckpt verify`` does by default.
- ``deep``: reads and checksums every file, whatever the backend reports.

:func:`non_finite_tensors` goes further (``python -m ckpt verify --finite``): it reads
and decodes every floating tensor item (each checked against its crc32c first) and
lists those holding NaN or inf. A save never commits such a state (:mod:`ckpt.saving.finite`),
so this is for checkpoints from elsewhere, older versions, or ``allow_non_finite``.

A problem names the file and says what is wrong; :meth:`VerifyReport.raise_if_bad`
raises :class:`~ckpt.errors.CorruptCheckpointError` for the first one, or, when every
problem is a storage call that failed (nothing was found damaged),
:class:`~ckpt.errors.CheckpointUnreadableError`: resume quarantines only the former.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ckpt.errors import CheckpointUnreadableError, CorruptCheckpointError, StorageError
from ckpt.format.checksum import crc32c_of
from ckpt.format.dcp_metadata import MAX_METADATA_BYTES
from ckpt.format.layout import DCP_METADATA_NAME
from ckpt.format.manifest import Manifest
from ckpt.format.tensorblob import view_tensor
from ckpt.saving import finite
from ckpt.storage import FILE, Storage, crc32c_of_object

logger = logging.getLogger(__name__)

MODE_FAST = "fast"
MODE_CHECKSUM = "checksum"
MODE_DEEP = "deep"
MODES = (MODE_FAST, MODE_CHECKSUM, MODE_DEEP)


@dataclass(slots=True, kw_only=True)
class VerifyReport:
    """Outcome of verifying one checkpoint."""

    url: str
    step: int
    deep: bool
    mode: str = MODE_FAST
    files_checked: int = 0
    """Files that passed every check the mode asked for."""
    bytes_checked: int = 0
    """Bytes read and checksummed."""
    crc_checked: int = 0
    """Files whose crc32c was compared with the manifest's (object crc32c or bytes read)."""
    sizes_only: int = 0
    """Files that passed with only their size checked: contents not verified."""
    read_in_full: list[str] = field(default_factory=list)
    """``checksum`` mode: files downloaded and checksummed because the store kept no
    crc32c for them (on GCS or S3: an object a client without CRC32C put there)."""
    problems: list[tuple[str, str]] = field(default_factory=list)
    unreadable: int = 0
    """How many of ``problems`` are storage calls that failed, not damage found."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_bad(self) -> None:
        if self.problems:
            path, why = self.problems[0]
            more = (
                f" (and {len(self.problems) - 1} more problems)" if len(self.problems) > 1 else ""
            )
            message = (
                f"checkpoint {self.url} (step {self.step}) failed verification: {path}: {why}{more}"
            )
            if self.unreadable == len(self.problems):
                raise CheckpointUnreadableError(message, url=self.url, path=path)
            raise CorruptCheckpointError(message, url=self.url, path=path)


def verify_dir(
    ckpt_dir: Storage, manifest: Manifest, *, deep: bool = False, mode: str | None = None
) -> VerifyReport:
    """Verify the checkpoint rooted at ``ckpt_dir`` against ``manifest``.

    ``mode`` is one of :data:`MODES`; when not given it is ``deep`` if ``deep`` is
    true, else ``fast`` (see the module docstring).
    """
    if mode is None:
        mode = MODE_DEEP if deep else MODE_FAST
    elif mode not in MODES:
        raise ValueError(f"verify mode must be one of {', '.join(MODES)}, not {mode!r}")
    elif deep and mode != MODE_DEEP:
        raise ValueError(f"deep=True contradicts mode={mode!r}")
    report = VerifyReport(
        url=ckpt_dir.root_url, step=manifest.step, deep=mode == MODE_DEEP, mode=mode
    )
    if manifest.file(DCP_METADATA_NAME) is None:
        report.problems.append((DCP_METADATA_NAME, "not listed in manifest.json"))
    try:
        present = ckpt_dir.list_files()
    except StorageError as exc:
        report.problems.append(("", f"cannot list the checkpoint: {exc}"))
        report.unreadable += 1
        return report
    for entry in manifest.files:
        if entry.path == DCP_METADATA_NAME and entry.size > MAX_METADATA_BYTES:
            report.problems.append(
                (entry.path, f"listed as {entry.size} bytes, more than {MAX_METADATA_BYTES}")
            )
            continue
        meta = present.get(entry.path)
        if meta is None:
            report.problems.append((entry.path, "missing"))
            continue
        kind = meta.get("type", FILE)
        if kind != FILE:  # a link may point anywhere: never read through it
            report.problems.append(
                (entry.path, f"is a {kind}, not a regular file: not read (never followed)")
            )
            continue
        size = int(meta.get("size", -1))
        if size != entry.size:
            report.problems.append(
                (entry.path, f"size is {size} bytes, manifest says {entry.size} (truncated?)")
            )
            continue
        remote_crc = meta.get("crc32c")
        if not remote_crc and mode == MODE_CHECKSUM:
            remote_crc = _object_crc32c(ckpt_dir, entry.path)
        if remote_crc and remote_crc != entry.crc32c:
            report.crc_checked += 1
            report.problems.append(
                (entry.path, f"object crc32c {remote_crc} != manifest {entry.crc32c}")
            )
            continue
        if mode == MODE_DEEP or (mode == MODE_CHECKSUM and not remote_crc):
            try:
                _, crc = crc32c_of_object(ckpt_dir, entry.path)
            except StorageError as exc:
                report.problems.append((entry.path, f"cannot read: {exc}"))
                report.unreadable += 1
                continue
            report.crc_checked += 1
            report.bytes_checked += entry.size
            if mode == MODE_CHECKSUM:
                report.read_in_full.append(entry.path)
            if crc != entry.crc32c:
                report.problems.append(
                    (entry.path, f"crc32c of the bytes is {crc}, manifest says {entry.crc32c}")
                )
                continue
        elif remote_crc:
            report.crc_checked += 1
        else:
            report.sizes_only += 1
        report.files_checked += 1
    return report


def non_finite_tensors(ckpt_dir: Storage, manifest: Manifest) -> dict[str, tuple[int, int]]:
    """Every floating tensor of a committed checkpoint that holds NaN or inf: ``{key: (NaN
    count, inf count)}`` summed over its items (shards, row blocks).

    Reads and decodes every floating tensor item, one at a time, each checked against its
    manifest crc32c before it is decoded (``.metadata`` with the safe loader); raises
    :class:`~ckpt.errors.CorruptCheckpointError` for damage found on the way.
    """
    from ckpt.loading.reader import ShardReader  # the reader imports much; only this needs it

    metadata = ShardReader(ckpt_dir, manifest).fetch_metadata()
    crcs = {
        (path, int(offset)): (int(length), str(crc))
        for path, items in manifest.item_chunks().items()
        for offset, length, crc in items
    }
    found: dict[str, tuple[int, int]] = {}
    for index, info in sorted(
        (metadata.storage_data or {}).items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)
    ):
        md = metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            continue
        if not (md.properties.dtype.is_floating_point or md.properties.dtype.is_complex):
            continue
        path, offset, length = info.relative_path, int(info.offset), int(info.length)
        piece = ckpt_dir.read_range(path, offset, offset + length)
        if crcs.get((path, offset)) != (len(piece), crc32c_of(piece)):
            raise CorruptCheckpointError(
                f"{ckpt_dir.url(path)}: bytes [{offset}, {offset + length}) of {index.fqn!r} do "
                "not match their manifest crc32c: the file is corrupt",
                url=ckpt_dir.root_url,
                path=path,
            )
        tensor = view_tensor(piece)
        if tensor is None:
            tensor = torch.load(io.BytesIO(piece), map_location="cpu", weights_only=True)
        if not isinstance(tensor, torch.Tensor) or finite.is_finite(tensor):
            continue
        real = torch.view_as_real(tensor) if tensor.is_complex() else tensor
        nans, infs = found.get(index.fqn, (0, 0))
        found[index.fqn] = (
            nans + int(torch.isnan(real).sum()),
            infs + int(torch.isinf(real).sum()),
        )
    return found


def _object_crc32c(ckpt_dir: Storage, path: str) -> str | None:
    """The crc32c the store keeps for one object (S3 lists none), or None (then the
    bytes are read: a failure to ask is not a verdict)."""
    try:
        return ckpt_dir.info(path).get("crc32c")
    except StorageError:
        return None
