"""Non-finite values (NaN, inf) in a save: found while the bytes are checksummed, refused.

A run that diverged (a NaN loss, an infinite learning rate) trains on NaN; if its saves
committed, retention would soon have deleted every checkpoint from before the divergence
and a resume would load NaN. So a save looks at every floating tensor it writes and does
not commit when one holds a NaN or an infinity (:class:`~ckpt.errors.NonFiniteStateError`,
a :class:`~ckpt.errors.SaveFailedError`: the manager's save-failure policy applies).

No second pass over the bytes on the hot path: :class:`ValueWatch` arms the shard's
:class:`~ckpt.format.checksum.ChecksummingWriter` for the one write that carries a tensor's raw
bytes (``torch.save`` hands the storage's own memory to the stream), and the writer then
writes, checksums and looks at it one :data:`PIECE_BYTES` piece at a time, so the values
are read while the piece is still in the CPU cache. A piece is finite when its sum is (a
NaN or an infinity makes the sum non-finite); a sum that overflows (float16 often does) is
settled by the piece's minimum and maximum, which propagate NaN. Tensors smaller than a
piece are checked whole after ``torch.save`` (their bytes are in the cache then too).
The scan adds a small share to the hot path's time (more for bfloat16 than for float32)
and little to a whole ``ckpt.save`` (docs/design.md, "Non-finite values").

Some states hold infinities on purpose (a ``-inf`` attention-mask buffer): ``allow``
patterns (``fnmatch``, against the saved keys such as ``model.mask``) exempt them.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

PIECE_BYTES = 1 << 20
"""Bytes written, checksummed and scanned together (small enough to stay in L2)."""


def scannable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can hold a NaN or an infinity (floating or complex, not empty)."""
    return (tensor.dtype.is_floating_point or tensor.dtype.is_complex) and tensor.numel() > 0


def _flat_real(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    return torch.view_as_real(flat).reshape(-1) if flat.dtype.is_complex else flat


def _piece_finite(piece: torch.Tensor) -> bool:
    # A NaN or an infinity makes the sum non-finite (the cheapest reduction: on a piece in
    # the cache it runs several times faster than aminmax); a non-finite sum of finite
    # values (an overflow, common in float16) is settled by the minimum and maximum.
    if math.isfinite(piece.sum().item()):
        return True
    try:
        low, high = torch.aminmax(piece)
    except RuntimeError:  # a dtype without aminmax on this device (float8)
        low, high = torch.aminmax(piece.to(torch.float32))
    return math.isfinite(low.item()) and math.isfinite(high.item())


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite, read one piece at a time."""
    if not scannable(tensor):
        return True
    flat = _flat_real(tensor.detach())
    step = max(1, PIECE_BYTES // flat.element_size())
    return all(_piece_finite(flat[i : i + step]) for i in range(0, flat.numel(), step))


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class ValueWatch:
    """One tensor about to be written: its raw bytes are looked at as they stream out.

    Arm a :class:`~ckpt.format.checksum.ChecksummingWriter` with it (``stream.watch(w)``) before
    ``torch.save(tensor, stream)``; the stream hands the write that is exactly this
    tensor's memory to :meth:`look`, piece by piece. :meth:`finite` then says whether
    every value was finite (checking the tensor itself when no write matched: a tensor
    smaller than a piece, whose one reduction costs about a microsecond, or bytes that were
    not its own memory).
    """

    __slots__ = ("_address", "_finite", "_flat", "_seen", "_tensor", "nbytes")

    piece_bytes = PIECE_BYTES

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        self._flat: torch.Tensor | None = None
        self._address = 0
        if self.nbytes >= PIECE_BYTES:  # only such a write is taken piece by piece
            self._flat = _flat_real(tensor)
            self._address = self._flat.data_ptr()
        self._seen = False
        self._finite = True

    def matches(self, view: memoryview) -> bool:
        """Whether ``view`` is this tensor's raw bytes (large enough to be worth pieces)."""
        return (
            self._flat is not None
            and not self._seen
            and view.nbytes == self.nbytes
            and _address(view) == self._address
        )

    def look(self, offset: int, nbytes: int) -> None:
        """The bytes ``[offset, offset + nbytes)`` of the tensor went out (in the cache now)."""
        self._seen = True
        if self._finite and self._flat is not None:
            size = self._flat.element_size()
            self._finite = _piece_finite(self._flat[offset // size : (offset + nbytes) // size])

    def finite(self) -> bool:
        """Every value finite; reads the tensor itself when no write was watched."""
        if not self._seen:
            self._seen = True
            if self._flat is None:
                self._finite = _piece_finite(_flat_real(self._tensor))
            else:
                self._finite = is_finite(self._flat)
        return self._finite


def refused(non_finite: Iterable[str], allow: Sequence[str] | bool) -> list[str]:
    """Keys of ``non_finite`` that ``allow`` does not exempt (sorted, no duplicates).

    ``allow``: ``False`` exempts nothing, ``True`` everything, a sequence of ``fnmatch``
    patterns the keys that match one.
    """
    if allow is True:
        return []
    patterns = () if allow is False else tuple(allow)
    return sorted(
        {key for key in non_finite if not any(fnmatch.fnmatchcase(key, p) for p in patterns)}
    )


def check_allow(allow: object) -> Sequence[str] | bool:
    """Validate an ``allow_non_finite`` argument; raises ``ValueError`` naming it."""
    if isinstance(allow, bool):
        return allow
    if isinstance(allow, str) or not isinstance(allow, Sequence):
        raise ValueError(
            "allow_non_finite must be False, True or a list of key patterns (fnmatch, e.g. "
            f"['model.*.mask']), got {allow!r}"
        )
    for pattern in allow:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"allow_non_finite patterns must be non-empty str, got {pattern!r}")
    return tuple(allow)


def describe(found: dict[str, list[int]], limit: int = 8) -> str:
    """``key (ranks 0, 1), ...`` for a message, at most ``limit`` keys."""
    parts = [
        f"{key} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))})"
        for key, ranks in sorted(found.items())[:limit]
    ]
    more = len(found) - limit
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")
