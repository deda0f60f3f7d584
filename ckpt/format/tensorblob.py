"""Zero-copy decoding of one tensor saved with ``torch.save`` (a DCP item).

``torch.load`` of a tensor item allocates a new storage and copies the bytes into
it; the reader then copies that tensor again into the destination. On large items
the allocation (its page faults) and that first copy are most of a warm load.
:func:`view_tensor` instead finds the storage record inside the item's bytes and
returns a tensor *viewing* them, so the only copy left is the one into the
destination.

The item is the zip archive ``torch.save`` writes: ``<prefix>/data.pkl`` (a
pickle that rebuilds the tensor from a storage key, offset, size and stride),
``<prefix>/byteorder``, ``<prefix>/data/<key>`` (the raw bytes, stored
uncompressed) and more. Only the plain case is handled: one dense tensor on one
storage, rebuilt by ``torch._utils._rebuild_tensor_v2``, little-endian, stored
records. Anything else makes :func:`view_tensor` return ``None`` and the caller
falls back to ``torch.load(..., weights_only=True)``. The pickle is decoded with an
allowlist of exactly those globals, so it cannot run code.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import warnings
from typing import Any

import torch

_EOCD_SIG = b"PK\x05\x06"
_CENTRAL_SIG = 0x02014B50
_LOCAL_SIG = 0x04034B50
_STORED = 0


class NotPlain(Exception):
    """The item is not the plain case; the caller falls back to torch.load."""


def zip_records(buf: memoryview) -> dict[str, tuple[int, int]]:
    """``{name: (data offset, size)}`` of the stored records of a zip archive."""
    tail = bytes(buf[max(0, len(buf) - 65_557) :])  # EOCD + the longest comment
    at = tail.rfind(_EOCD_SIG)
    if at < 0 or len(tail) - at < 22:
        raise NotPlain("no end-of-central-directory record")
    entries, cd_size, cd_offset = struct.unpack_from("<HII", tail, at + 10)
    if 0xFFFFFFFF in (cd_size, cd_offset) or entries == 0xFFFF:
        raise NotPlain("zip64 archive")
    out: dict[str, tuple[int, int]] = {}
    pos = cd_offset
    for _ in range(entries):
        if pos + 46 > len(buf):
            raise NotPlain("truncated central directory")
        (sig, method, csize, usize, name_len, extra_len, comment_len, local) = struct.unpack_from(
            "<I6xH8xIIHHH8xI", buf, pos
        )
        if sig != _CENTRAL_SIG:
            raise NotPlain("bad central directory entry")
        name = bytes(buf[pos + 46 : pos + 46 + name_len]).decode("utf-8", "replace")
        pos += 46 + name_len + extra_len + comment_len
        if method != _STORED or csize != usize or 0xFFFFFFFF in (csize, local):
            raise NotPlain(f"record {name} is compressed or zip64")
        if local + 30 > len(buf):
            raise NotPlain("truncated local header")
        lsig, lname_len, lextra_len = struct.unpack_from("<I22xHH", buf, local)
        if lsig != _LOCAL_SIG:
            raise NotPlain("bad local header")
        start = local + 30 + lname_len + lextra_len
        if start + usize > len(buf):
            raise NotPlain(f"record {name} runs past the end")
        out[name] = (start, usize)
    return out


def _storage_dtypes() -> dict[str, torch.dtype]:
    """``{"FloatStorage": torch.float32, ...}``: the legacy names pickles refer to."""
    out: dict[str, torch.dtype] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated (but still pickled)
        for name in dir(torch):
            if name.endswith("Storage") and name not in ("UntypedStorage", "TypedStorage"):
                dtype = getattr(getattr(torch, name), "dtype", None)
                if isinstance(dtype, torch.dtype):
                    out[name] = dtype
    return out


_STORAGE_DTYPES = _storage_dtypes()


class _StorageRef:
    __slots__ = ("dtype", "key", "numel")

    def __init__(self, dtype: torch.dtype, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


class _TensorRecipe:
    __slots__ = ("size", "storage", "storage_offset", "stride")

    def __init__(self, storage: Any, storage_offset: Any, size: Any, stride: Any) -> None:
        if not isinstance(storage, _StorageRef):
            raise NotPlain("tensor not rebuilt from a storage")
        self.storage = storage
        self.storage_offset = int(storage_offset)
        self.size = tuple(int(x) for x in size)
        self.stride = tuple(int(x) for x in stride)


def _rebuild(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> _TensorRecipe:
    if metadata:
        raise NotPlain("tensor with extra metadata")
    return _TensorRecipe(storage, storage_offset, size, stride)


def _ordered_dict(*args: Any) -> dict[Any, Any]:
    return dict(*args)


class _RecipeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild
        if module == "collections" and name == "OrderedDict":
            return _ordered_dict  # the (empty) backward hooks
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise NotPlain(f"{module}.{name} is not part of a plain tensor")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise NotPlain("unknown persistent id")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, torch.dtype):
            raise NotPlain("storage without a dtype")
        return _StorageRef(dtype, str(key), int(numel))


def _plain(view: memoryview) -> tuple[_TensorRecipe, int, int]:
    """The recipe of a plain tensor item and its storage record's ``(offset, size)``."""
    records = zip_records(view)
    pkl = [name for name in records if name.endswith("/data.pkl") or name == "data.pkl"]
    if len(pkl) != 1:
        raise NotPlain("no data.pkl")
    prefix = pkl[0][: -len("data.pkl")]
    order = records.get(prefix + "byteorder")
    if order is not None:
        start, size = order
        if bytes(view[start : start + size]) != sys.byteorder.encode():
            raise NotPlain("other byte order")
    start, size = records[pkl[0]]
    recipe = _RecipeUnpickler(io.BytesIO(view[start : start + size])).load()
    if not isinstance(recipe, _TensorRecipe):
        raise NotPlain("not a single tensor")
    ref = recipe.storage
    data = records.get(f"{prefix}data/{ref.key}")
    if data is None:
        raise NotPlain("storage record missing")
    start, size = data
    itemsize = torch.empty((), dtype=ref.dtype).element_size()
    if size != ref.numel * itemsize:
        raise NotPlain("storage record has the wrong size")
    return recipe, start, size


_DECODE_ERRORS = (
    NotPlain,
    pickle.UnpicklingError,
    struct.error,
    ValueError,
    RuntimeError,
    EOFError,
)


def view_tensor(buf: bytes | memoryview) -> torch.Tensor | None:
    """A CPU tensor viewing the data inside ``buf`` (a ``torch.save``d tensor), or ``None``.

    ``None`` means "not the plain case, use ``torch.load``". The result shares
    memory with ``buf`` and must not be written to: copy it where it belongs.
    """
    view = memoryview(buf).cast("B")
    try:
        recipe, start, _size = _plain(view)
        ref = recipe.storage
        if ref.numel == 0:
            flat = torch.empty(0, dtype=ref.dtype)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only buffer: we only read from it
                flat = torch.frombuffer(view, dtype=ref.dtype, count=ref.numel, offset=start)
        return flat.as_strided(recipe.size, recipe.stride, recipe.storage_offset)
    except _DECODE_ERRORS:
        return None


def data_layout(buf: bytes | memoryview) -> tuple[int, int, str, tuple[int, ...]] | None:
    """Where a plain, dense, row-major tensor item keeps its values:
    ``(offset in buf, bytes, dtype name, shape)``; ``None`` for anything else.

    Those bytes are the tensor's memory as is, so a receiver can put them straight
    into a destination tensor of that dtype and shape (the item's crc32c, over every
    part, still decides whether they are the saved ones).
    """
    view = memoryview(buf).cast("B")
    try:
        recipe, start, size = _plain(view)
    except _DECODE_ERRORS:
        return None
    numel = 1
    for dim in recipe.size:
        numel *= dim
    row_major, step = [], 1
    for dim in reversed(recipe.size):
        row_major.append(step)
        step *= max(dim, 1)
    if (
        numel == 0
        or recipe.storage_offset != 0
        or numel != recipe.storage.numel
        or tuple(reversed(row_major)) != recipe.stride
    ):
        return None
    return start, size, str(recipe.storage.dtype), recipe.size
