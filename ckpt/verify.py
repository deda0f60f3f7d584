"""Verification of a committed checkpoint against its manifest.

- fast: every file listed in the manifest exists with the right size, and where
  the backend reports an object crc32c (GCS) it equals the manifest's. One
  listing call, no download.
- deep: additionally reads every file in bounded chunks and checksums it.

A problem names the file and says what is wrong; :func:`check` raises
:class:`~ckpt.errors.CorruptCheckpointError` for the first one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ckpt.errors import CorruptCheckpointError, StorageError
from ckpt.layout import DCP_METADATA_NAME
from ckpt.manifest import Manifest
from ckpt.storage import Storage, crc32c_of_object

logger = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class VerifyReport:
    """Outcome of verifying one checkpoint."""

    url: str
    step: int
    deep: bool
    files_checked: int = 0
    bytes_checked: int = 0
    crc_checked: int = 0
    problems: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_bad(self) -> None:
        if self.problems:
            path, why = self.problems[0]
            more = (
                f" (and {len(self.problems) - 1} more problems)" if len(self.problems) > 1 else ""
            )
            raise CorruptCheckpointError(
                f"checkpoint {self.url} (step {self.step}) failed verification: "
                f"{path}: {why}{more}",
                url=self.url,
                path=path,
            )


def verify_dir(ckpt_dir: Storage, manifest: Manifest, *, deep: bool = False) -> VerifyReport:
    """Verify the checkpoint rooted at ``ckpt_dir`` against ``manifest``."""
    report = VerifyReport(url=ckpt_dir.root_url, step=manifest.step, deep=deep)
    if manifest.file(DCP_METADATA_NAME) is None:
        report.problems.append((DCP_METADATA_NAME, "not listed in manifest.json"))
    try:
        present = ckpt_dir.list_files()
    except StorageError as exc:
        report.problems.append(("", f"cannot list the checkpoint: {exc}"))
        return report
    for entry in manifest.files:
        meta = present.get(entry.path)
        if meta is None:
            report.problems.append((entry.path, "missing"))
            continue
        size = int(meta.get("size", -1))
        if size != entry.size:
            report.problems.append(
                (entry.path, f"size is {size} bytes, manifest says {entry.size} (truncated?)")
            )
            continue
        remote_crc = meta.get("crc32c")
        if remote_crc:
            report.crc_checked += 1
            if remote_crc != entry.crc32c:
                report.problems.append(
                    (entry.path, f"object crc32c {remote_crc} != manifest {entry.crc32c}")
                )
                continue
        if deep:
            try:
                _, crc = crc32c_of_object(ckpt_dir, entry.path)
            except StorageError as exc:
                report.problems.append((entry.path, f"cannot read: {exc}"))
                continue
            report.crc_checked += 1
            report.bytes_checked += entry.size
            if crc != entry.crc32c:
                report.problems.append(
                    (entry.path, f"crc32c of the bytes is {crc}, manifest says {entry.crc32c}")
                )
                continue
        report.files_checked += 1
    return report
