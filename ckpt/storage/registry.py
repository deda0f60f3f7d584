"""Storage backends, one module each, chosen by URL scheme here.

:class:`~ckpt.storage.Storage` asks :func:`open_backend` for the backend of its root
URL; the backend interface is :class:`ckpt.storage.base.Backend`. Each entry of
:data:`BACKENDS` names a class by ``module:Class`` (as fsspec's own registry does), so
a backend's client library (gcsfs, s3fs, botocore) is imported only when a URL of its
scheme is opened. A scheme not listed goes to the generic fsspec backend
(``memory://``, ``ckptmem://`` and any filesystem fsspec knows).

Adding a backend is one module with a class that has ``open(url, options)`` and the
:class:`~ckpt.storage.base.Backend` methods (``conditional_record`` too, for the root's
owner lease: without it a job with a lease is refused on that backend), and one line
below; ``tests/test_storage_backend_contract.py`` adds one that way.
"""

from __future__ import annotations

import importlib
from typing import Any

from ckpt.storage.base import Backend

BACKENDS: dict[str, str] = {
    "file": "ckpt.storage.local:LocalBackend",
    "local": "ckpt.storage.local:LocalBackend",
    "gs": "ckpt.storage.gcs:GcsBackend",
    "gcs": "ckpt.storage.gcs:GcsBackend",
    "s3": "ckpt.storage.s3:S3Backend",
}
"""URL scheme -> ``module:Class`` of its backend (a path without a scheme is ``file``)."""

GENERIC = "ckpt.storage.fsspec_generic:FsspecBackend"
"""The backend of every other scheme: whatever fsspec has registered for it."""


def scheme_of(url: str) -> str:
    """The URL's scheme (``file`` for a plain path)."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def open_backend(url: str, options: Any) -> tuple[Backend, str]:
    """The backend for ``url`` and the root's path in that backend's terms.

    ``options`` is the :class:`~ckpt.storage.StorageOptions` of the storage (timeouts,
    filesystem arguments, the backend's transfer tuning). Raises ``ImportError`` when
    the backend's client library is not installed and ``ValueError`` for a URL it
    cannot use.
    """
    target = BACKENDS.get(scheme_of(url), GENERIC)
    module_name, _, class_name = target.partition(":")
    backend_class = getattr(importlib.import_module(module_name), class_name)
    return backend_class.open(url, options)


__all__ = ["BACKENDS", "GENERIC", "Backend", "open_backend", "scheme_of"]
