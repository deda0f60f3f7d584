"""crc32c combining, segmented checksums, the google_crc32c fallback, and torch.save's crc32
switch around our saves."""

from __future__ import annotations

import array
import importlib.util
import io
import random
import sys
import types

import crc32c
import pytest
import torch

import ckpt
from ckpt.format import checksum
from ckpt.format.checksum import ChecksummingWriter, crc32c_combine, crc32c_of, encode_crc32c
from ckpt.storage import Storage


@pytest.mark.parametrize("seed", range(5))
def test_combine_equals_crc_of_concatenation(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        a = rng.randbytes(rng.randint(0, 5000))
        b = rng.randbytes(rng.randint(0, 5000))
        assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_combine_large_length() -> None:
    # 600 MiB of zeros, combined 1 MiB at a time, equals one pass over them: lengths
    # past 2^32 bits exercise the x^(2^k) table beyond its first entries.
    block = bytes(1 << 20)
    block_crc = crc32c.crc32c(block)
    head = b"header"
    combined = crc32c.crc32c(head)
    direct = crc32c.crc32c(head)
    for _ in range(600):
        combined = crc32c_combine(combined, block_crc, len(block))
        direct = crc32c.crc32c(block, direct)
    assert combined == direct
    # And in one step: the crc of 600 zero blocks, combined at once.
    zeros_crc = 0
    for _ in range(600):
        zeros_crc = crc32c.crc32c(block, zeros_crc)
    assert crc32c_combine(crc32c.crc32c(head), zeros_crc, 600 << 20) == direct


def test_segments_checksum_each_byte_once_and_the_whole() -> None:
    rng = random.Random(7)
    parts = [rng.randbytes(rng.randint(0, 70_000)) for _ in range(9)]
    sink = io.BytesIO()
    w = ChecksummingWriter(sink)
    w.write(b"prefix-not-in-a-segment")
    for part in parts:
        w.start_segment()
        w.write(part[: len(part) // 2])
        w.write(memoryview(part)[len(part) // 2 :])
        offset, length, crc = w.segment()
        assert sink.getvalue()[offset : offset + length] == part
        assert crc == crc32c_of(part)
    assert w.size == len(sink.getvalue())
    assert w.crc32c == crc32c_of(sink.getvalue())
    assert w.crc32c == encode_crc32c(crc32c.crc32c(sink.getvalue()))


def _checksum_without_crc32c(monkeypatch) -> types.ModuleType:
    """A fresh copy of ckpt/format/checksum.py executed as if ``crc32c`` were not installed.

    ``sys.modules["crc32c"] = None`` makes ``import crc32c`` raise ImportError, so the
    module takes its google_crc32c branch; the imported ``ckpt.format.checksum`` is untouched.
    """
    monkeypatch.setitem(sys.modules, "crc32c", None)
    spec = importlib.util.spec_from_file_location("_checksum_fallback", checksum.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_google_crc32c_fallback_matches_crc32c(monkeypatch) -> None:
    fallback = _checksum_without_crc32c(monkeypatch)
    assert not hasattr(fallback, "_crc32c") and hasattr(fallback, "google_crc32c")
    assert hasattr(checksum, "_crc32c")  # the primary path is the one imported here
    rng = random.Random(3)
    blob = rng.randbytes(70_001)
    # Empty, 1 byte, lengths off every word size, and a buffer start off alignment.
    inputs: list[bytes | bytearray | memoryview] = [b"", b"\x00", b"a", b"abc"]
    inputs += [blob[:n] for n in (3, 7, 9, 15, 17, 63, 65, 4095, 4097, 70_001)]
    inputs += [bytearray(blob[:1001]), memoryview(blob)[1:], memoryview(blob)[5:4100]]
    inputs.append(memoryview(array.array("I", range(257))))  # multi-byte items: cast to bytes
    for data in inputs:
        expected = crc32c.crc32c(bytes(memoryview(data).cast("B")))
        assert fallback.crc32c_extend(0, data) == checksum.crc32c_extend(0, data) == expected
        assert fallback.crc32c_of(data) == checksum.crc32c_of(data) == encode_crc32c(expected)
        # Continuing from a previous crc, as segments and chunked reads do.
        assert fallback.crc32c_extend(0x1234ABCD, data) == checksum.crc32c_extend(0x1234ABCD, data)
    chunks = [blob[:0], blob[:3], blob[3:4099], blob[4099:]]
    assert fallback.crc32c_of_chunks(chunks) == checksum.crc32c_of_chunks(chunks)
    assert fallback.crc32c_of_chunks(chunks) == (len(blob), crc32c_of(blob))
    writer = fallback.ChecksummingWriter(io.BytesIO())
    for part in (b"", blob[:5], memoryview(blob)[5:70_000], bytearray(blob[70_000:])):
        writer.start_segment()
        writer.write(part)
        assert writer.segment()[2] == crc32c_of(bytes(part))
    assert (writer.size, writer.crc32c) == (len(blob), crc32c_of(blob))


def test_save_restores_torch_crc32_setting_and_files_verify(tmp_path) -> None:
    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3)}
    for setting in (False, True):
        root = str(tmp_path / f"crc{setting}")
        torch.serialization.set_crc32_options(setting)
        try:
            ckpt.save(state, root, 1)
            assert torch.serialization.get_crc32_options() is setting
        finally:
            torch.serialization.set_crc32_options(True)
        info = ckpt.find_latest_committed(root)
        # The manifest's per-file crc32c (combined from the items') matches the bytes.
        report = ckpt.verify_dir(Storage(root).child(info.dirname), info.manifest, deep=True)
        assert report.ok, report.problems
        target = {"w": torch.zeros(1000), "b": torch.zeros(3)}
        ckpt.load(target, root)
        assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
