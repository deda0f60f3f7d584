"""The GCS backend (``gs://bucket/prefix``): gcsfs for listings and deletes, the JSON API
path of :mod:`ckpt.storage.gcs_parts` for object bytes.

gcsfs' ``GCSFile`` copied every byte into its buffer and again per request, one
stream: 0.65 of one ``pipe()`` on the emulator; the zero-copy requests of
:mod:`ckpt.storage.gcs_parts` (one request, or parallel parts composed server-side, and
parallel ranged reads) are what ``gcs_save_vs_pipe`` and ``gcs_load_vs_cat`` measure.
GCS reports every object's crc32c (in listings too), which writes and ``verify`` check
against what was streamed and what the manifest says.

Environment: ``STORAGE_EMULATOR_HOST`` sends requests to an emulator, anonymously
(``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` is then set to false before gcsfs is imported).
"""

from __future__ import annotations

import os
from typing import Any

import fsspec

from ckpt import env as _env
from ckpt.errors import RecordConflict
from ckpt.format.manifest import MAX_MARKER_BYTES
from ckpt.storage.gcs_parts import GcsHttpError, GcsTransfer, GcsTransferOptions
from ckpt.storage.parts import TransferBackend, transfer_options


class GcsBackend(TransferBackend):
    """A :class:`~ckpt.storage.base.Backend` for ``gs://`` (and ``gcs://``)."""

    @classmethod
    def open(cls, url: str, options: Any) -> tuple[GcsBackend, str]:
        kwargs = dict(options.fs_kwargs)
        # gcsfs has no per-request timeout by default: a frozen server hangs a call for good.
        kwargs.setdefault("requests_timeout", 60)
        if os.environ.get(_env.EMULATOR_HOST):
            # fake-gcs-server: no credentials, and no gRPC bucket-type probe (gcsfs reads
            # the flag at import, so it must be set before the first gs:// URL is opened).
            os.environ.setdefault(_env.GCSFS_HNS, "false")
            kwargs.setdefault("token", "anon")
        fs, path = fsspec.core.url_to_fs(url, **kwargs)
        tuning = transfer_options(options, GcsTransferOptions, url, fallback=options.gcs)
        return cls(fs, options, GcsTransfer(fs, tuning, options.timeout_s)), path

    def conditional_record(self, path: str) -> GcsRecord:
        return GcsRecord(self.transfer.client, path)


class GcsRecord:
    """A :class:`~ckpt.storage.base.ConditionalRecord` on GCS: one object written by a
    multipart upload with ``ifGenerationMatch`` (0: only if absent), removed with the same
    precondition; the version is the object's generation."""

    def __init__(self, client: Any, path: str) -> None:
        self.client = client  # the backend's JSON API client
        self.bucket, _, self.name = path.strip("/").partition("/")

    def read(self) -> tuple[bytes | None, Any]:
        try:
            return self.client.get_with_generation(self.bucket, self.name, MAX_MARKER_BYTES)
        except FileNotFoundError:
            return None, 0

    def write(self, data: bytes, version: Any) -> Any:
        try:
            resource = self.client.upload_if_generation(self.bucket, self.name, data, int(version))
        except GcsHttpError as exc:
            if exc.code == 412:
                raise RecordConflict() from None
            raise
        return int(resource.get("generation", 0))

    def delete(self, version: Any) -> None:
        self.client.delete_if_generation(self.bucket, self.name, int(version))

    def root_identity(self) -> Any:
        return None

    def prepare(self) -> None:
        pass
