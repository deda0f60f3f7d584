"""Manifests padded with entries that back no item: refused, and never held all at once.

A manifest.json may be up to 256 MB and parses to several times that in Python objects.
Whoever can write to a root can fill every checkpoint's manifest with chunk entries that
no item uses (each file stays under the cap; the total does not). Two defences:

- the entries are tied to ``.metadata``'s items: one entry per item, so padding fails
  ``verify`` and a resume sets the checkpoint aside;
- a listing (``ckpt ls``, ``list_checkpoints``, a resume's walk) keeps the per-item
  entries of the checkpoint it inspected last only: a root of many padded manifests
  costs one at a time.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import tracemalloc

import torch
from corpus import rewrite_manifest

import ckpt
import ckpt.cli
from ckpt.format.manifest import Manifest
from ckpt.root.catalog import COMMITTED, Catalog

PADDING = 150_000


def _state(step: int) -> dict:
    return {"w": torch.arange(64, dtype=torch.float32) + step, "step": step}


def _ckpt_dir(root: str, step: int) -> str:
    return os.path.join(root, f"checkpoint_{step:07d}")


def _pad(ckpt_dir: str, entries: int) -> None:
    """Add ``entries`` zero-length chunk entries at distinct offsets of the shard file:
    each is in range, so the manifest alone parses; none backs an item."""
    with open(os.path.join(ckpt_dir, "manifest.json")) as f:
        data = json.load(f)
    (path, items), *_ = data["chunks"].items()
    size = next(e["size"] for e in data["files"] if e["path"] == path)
    used = {offset for offset, _length, _crc in items}
    free = [o for o in range(size + 1) if o not in used]
    items.extend([free[i % len(free)], 0, "00000000"] for i in range(entries))
    rewrite_manifest(ckpt_dir, data)


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = ckpt.cli.main(list(argv))
    return code, out.getvalue()


def test_chunk_entries_that_back_no_item_fail_verify_and_a_resume_loads_the_one_before(tmp_path):
    root = str(tmp_path / "root")
    ckpt.save(_state(1), root, 1)
    ckpt.save(_state(2), root, 2)
    _pad(_ckpt_dir(root, 2), 1000)

    code, out = _cli("verify", root, "--step", "2", "--deep")
    assert code == 1 and out.startswith("FAIL"), out
    assert "item checksums" in out and "each entry is one item's" in out, out
    code, out = _cli("verify", root, "--step", "1", "--deep")
    assert code == 0, out

    loaded = {"w": torch.zeros(64), "step": -1}
    result = ckpt.load(loaded, root)
    assert result.step == 1 and [s.step for s in result.skipped] == [2]
    assert torch.equal(loaded["w"], _state(1)["w"])


def _retained_by(make) -> tuple[int, int, object]:
    """(bytes still allocated after ``make()`` with its result held, peak during it)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        held = make()
        gc.collect()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return current - base, peak - base, held


def test_listing_a_root_of_padded_manifests_holds_one_at_a_time(tmp_path):
    root = str(tmp_path / "root")
    steps = [1, 2, 3, 4]
    for step in steps:
        ckpt.save(_state(step), root, step)
        _pad(_ckpt_dir(root, step), PADDING)
    with open(os.path.join(_ckpt_dir(root, 1), "manifest.json"), "rb") as f:
        raw = f.read()
    one, one_peak, _ = _retained_by(lambda: Manifest.from_bytes(raw))
    assert one > 10 << 20  # the padding is what costs: ~150k entries

    held, peak, infos = _retained_by(lambda: ckpt.list_checkpoints(root))
    assert [(i.step, i.status) for i in infos] == [(s, COMMITTED) for s in reversed(steps)]
    # Four padded manifests listed, about one held (the one inspected last), and the
    # peak is one parse, not four.
    assert held < 1.5 * one, (held, one)
    assert peak < 1.5 * one_peak, (peak, one_peak)
    assert all(i.manifest.chunks_dropped for i in infos)

    # What was dropped is read again when a checkpoint is to be loaded or verified.
    catalog = Catalog(root)
    assert all(info.committed for info in catalog)
    assert catalog.info(4).manifest.chunks_dropped
    full = catalog.info(4, chunks=True).manifest
    assert not full.chunks_dropped and sum(map(len, full.chunks.values())) > PADDING
    assert catalog.info(1).manifest.chunks_dropped
