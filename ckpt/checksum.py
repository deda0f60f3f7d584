"""crc32c checksums in the encoding Google Cloud Storage reports for objects.

GCS exposes an object's crc32c as the base64 of its 4 big-endian bytes, so a
manifest that stores the same string can be compared with ``fs.info()["crc32c"]``
without downloading anything.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import IO

import google_crc32c


def encode_crc32c(value: int) -> str:
    """Base64 of the big-endian 4 bytes of ``value`` (the GCS object metadata format)."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def crc32c_of(data: bytes | bytearray | memoryview) -> str:
    """crc32c of ``data``, GCS-encoded."""
    chunk = data if isinstance(data, bytes) else memoryview(data).cast("B").tobytes()
    return encode_crc32c(google_crc32c.value(chunk))


class ChecksummingWriter:
    """File-like wrapper that counts and checksums every byte as it streams out.

    Checksums are computed on the way out so a save never re-reads what it wrote.
    ``tell()`` reports bytes written, which is what DCP uses for item offsets.
    """

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self._crc = google_crc32c.Checksum()
        self._size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        # google_crc32c's C extension takes only ``bytes``: convert once here; a nested
        # ChecksummingWriter then passes the same object down without another copy.
        chunk = data if isinstance(data, bytes) else memoryview(data).cast("B").tobytes()
        self._raw.write(chunk)
        self._crc.update(chunk)
        self._size += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    @property
    def size(self) -> int:
        return self._size

    @property
    def crc32c(self) -> str:
        return encode_crc32c(int.from_bytes(self._crc.digest(), "big"))


def crc32c_of_chunks(chunks: Iterable[bytes]) -> tuple[int, str]:
    """Total size and GCS-encoded crc32c of a sequence of byte chunks."""
    crc = google_crc32c.Checksum()
    size = 0
    for chunk in chunks:
        crc.update(chunk)
        size += len(chunk)
    return size, encode_crc32c(int.from_bytes(crc.digest(), "big"))
