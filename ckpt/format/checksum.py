"""crc32c checksums in the encoding Google Cloud Storage reports for objects.

GCS exposes an object's crc32c as the base64 of its 4 big-endian bytes, so a
manifest that stores the same string can be compared with ``fs.info()["crc32c"]``
without downloading anything.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Iterable
from typing import IO, Any

try:  # accepts any buffer (no copy): far faster than a copy + google_crc32c
    import crc32c as _crc32c

    def crc32c_extend(crc: int, data: bytes | bytearray | memoryview) -> int:
        return _crc32c.crc32c(data, crc)

except ImportError:  # google_crc32c's C extension takes only ``bytes``
    import google_crc32c

    def crc32c_extend(crc: int, data: bytes | bytearray | memoryview) -> int:
        chunk = data if isinstance(data, bytes) else memoryview(data).cast("B").tobytes()
        return google_crc32c.extend(crc, chunk)


def encode_crc32c(value: int) -> str:
    """Base64 of the big-endian 4 bytes of ``value`` (the GCS object metadata format)."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def crc32c_of(data: bytes | bytearray | memoryview) -> str:
    """crc32c of ``data``, GCS-encoded."""
    return encode_crc32c(crc32c_extend(0, data))


# -- combining checksums ---------------------------------------------------------------
#
# crc32c(A + B) follows from crc32c(A), crc32c(B) and len(B): shifting A's remainder by
# 8 * len(B) zero bits is a multiplication by x^(8 len B) modulo the (reflected)
# Castagnoli polynomial, and CRCs of the shifted part and of B add (xor). That lets a
# writer checksum every byte once, per item, and still report the whole file's crc32c.

_POLY = 0x82F63B78  # Castagnoli, bit-reflected
_X0 = 1 << 31  # the polynomial 1 in the reflected representation


def crc32c_mulmod(a: int, b: int) -> int:
    """a * b modulo the Castagnoli polynomial, both reflected 32-bit polynomials."""
    product = 0
    bit = _X0
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers_of_x() -> list[int]:
    # _X_POW2[k] = x^(2^k) mod P; x^(2^k) for k >= 32 repeats with the field's period,
    # but lengths here stay far below 2^32 bytes * 8, so 64 entries are plenty.
    table = [_X0 >> 1]  # x^1
    for _ in range(63):
        table.append(crc32c_mulmod(table[-1], table[-1]))
    return table


_X_POW2 = _powers_of_x()


@functools.lru_cache(maxsize=1024)
def crc32c_shift_operator(nbytes: int) -> int:
    """x^(8 * nbytes) mod P (cached: items of one shape repeat their lengths, and each
    uncached call costs up to ~30 multiplications in Python)."""
    result = _X0
    k = 3  # 8 = 2^3 bits per byte
    while nbytes:
        if nbytes & 1:
            result = crc32c_mulmod(_X_POW2[k], result)
        nbytes >>= 1
        k += 1
    return result


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)`` (bytes)."""
    if len_b == 0:
        return crc_a
    return crc32c_mulmod(crc32c_shift_operator(len_b), crc_a) ^ crc_b


class ChecksummingWriter:
    """File-like wrapper that counts and checksums every byte as it streams out.

    Checksums are computed on the way out so a save never re-reads what it wrote.
    ``tell()`` reports bytes written, which is what DCP uses for item offsets.

    The stream can be cut into segments (``start_segment``): each byte is
    checksummed once, into its segment's crc32c, and the whole stream's crc32c is
    derived by combining the segments' (no second pass over the data).
    """

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self._size = 0
        self._before = 0  # crc32c of the bytes before the open segment
        self._seg_crc = 0
        self._seg_start = 0
        self._watch: Any = None

    def watch(self, values: Any) -> None:
        """Hand the write that ``values.matches`` to ``values.look`` piece by piece (None: off).

        ``values`` is a :class:`ckpt.saving.finite.ValueWatch`: that write is written, checksummed
        and looked at one ``values.piece_bytes`` piece at a time, so its values are read
        while the piece is in the CPU cache, not in a second pass over memory.
        """
        self._watch = values

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = data if isinstance(data, bytes) else memoryview(data).cast("B")
        watch = self._watch
        if watch is not None and watch.matches(view):
            return self._write_watched(memoryview(view), watch)
        self._raw.write(view)
        self._seg_crc = crc32c_extend(self._seg_crc, view)
        self._size += len(view)
        return len(view)

    def _write_watched(self, view: memoryview, watch: Any) -> int:
        step = watch.piece_bytes
        for offset in range(0, view.nbytes, step):
            piece = view[offset : offset + step]
            self._raw.write(piece)
            self._seg_crc = crc32c_extend(self._seg_crc, piece)
            watch.look(offset, piece.nbytes)
        self._size += view.nbytes
        return view.nbytes

    def start_segment(self) -> None:
        """Close the open segment (folding its crc into the stream's) and open a new one."""
        self._before = crc32c_combine(self._before, self._seg_crc, self._size - self._seg_start)
        self._seg_crc = 0
        self._seg_start = self._size

    def segment(self) -> tuple[int, int, str]:
        """``(offset, length, crc32c)`` of the open segment so far (crc GCS-encoded)."""
        return self._seg_start, self._size - self._seg_start, encode_crc32c(self._seg_crc)

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
        whole = crc32c_combine(self._before, self._seg_crc, self._size - self._seg_start)
        return encode_crc32c(whole)


def crc32c_of_chunks(chunks: Iterable[bytes]) -> tuple[int, str]:
    """Total size and GCS-encoded crc32c of a sequence of byte chunks."""
    crc = 0
    size = 0
    for chunk in chunks:
        crc = crc32c_extend(crc, chunk)
        size += len(chunk)
    return size, encode_crc32c(crc)
