"""export_memory and export_vs_read: ``ckpt.export`` of a 2-rank FSDP2 checkpoint to safetensors.

The checkpoint is the benchmark state (:mod:`bench.fsdp_state`: model + AdamW, fp32,
``Mode.total_bytes`` in all, so the model is about a third of it), saved by 2 spawned
ranks. Each round, in rotating order and with the page cache of the checkpoint's files
dropped before each side:

- ours: a fresh spawned process (imports done before the clock starts) runs
  ``ckpt.export(root, out, max_shard_size=model bytes / OUTPUT_SHARDS)``: it reads and
  verifies the model items of both ranks' shard files, assembles each tensor, writes the
  safetensors files and fsyncs them. Its peak RSS growth is the kernel's high-water mark
  (``VmHWM`` after resetting it through ``/proc/self/clear_refs``), or, where that
  cannot be reset, a sampled peak (a lower bound).
- read: ``cat`` of the same shard files (and ``.metadata``) to /dev/null.

``export_memory`` = median peak RSS growth / the largest output file; ``export_vs_read`` =
export bytes/s (checkpoint bytes the export read) / ``cat`` bytes/s (every byte of the
files). The export reads only the model's items, and writes as much as it reads.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import statistics
import subprocess
import time
from typing import Any

from bench import disk
from bench.fsdp_state import build_trained, sharded_state
from bench.memory import PeakRss, rss_bytes
from bench.metrics import Metric
from bench.spawn import run_on_ranks

RANKS = 2
EXPORT_MIN_BYTES = 256 << 20
"""Smallest checkpoint exported (quick mode included): below this, the fixed costs (listing,
verification, ``.metadata``, fsyncs; ~20 MB of first-use memory) decide both ratios."""
SAVED_STEP = 1
OUTPUT_SHARDS = 4
"""The model is exported into this many safetensors files (so the ratio has a small
denominator: with the default 5GB limit, one file would hold the whole model)."""


def save_checkpoint(rank: int, world: int, root: str, width: int) -> dict[str, Any]:
    """The benchmark state saved from ``world`` ranks (collective); rank 0 says how big."""
    import ckpt

    model, optim = build_trained(width)
    ckpt.save(sharded_state(model, optim), root, SAVED_STEP)
    return {"model_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5\n")
        return True
    except OSError:
        return False


def _hwm_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _export_child(root: str, out: str, max_shard: int, results: Any) -> None:
    """One measured export in this (fresh) process; puts its figures on ``results``."""
    try:
        import ckpt

        before = rss_bytes()
        exact = _reset_peak()
        with PeakRss() as sampled:
            started = time.perf_counter()
            result = ckpt.export(root, out, max_shard_size=max_shard)
            seconds = time.perf_counter() - started
        growth = _hwm_bytes() - before if exact else sampled.growth
        results.put(
            {
                "seconds": seconds,
                "growth": growth,
                "peak_method": "VmHWM" if exact else "sampled",
                "bytes_read": result.bytes_read,
                "bytes_written": result.bytes,
                "files": {name: os.path.getsize(os.path.join(out, name)) for name in result.files},
            }
        )
    except BaseException as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def _export_once(root: str, out: str, max_shard: int, timeout_s: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_export_child, args=(root, out, max_shard, results))
    proc.start()
    try:
        got = results.get(timeout=timeout_s)
    except queue.Empty:
        got = {"error": f"export did not finish within {timeout_s:.0f} s"}
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if "error" in got:
        raise RuntimeError(f"export round failed: {got['error']}")
    return got


def _cat(paths: list[str]) -> float:
    started = time.perf_counter()
    with open(os.devnull, "wb") as sink:
        subprocess.run(["cat", *paths], stdout=sink, check=True)
    return time.perf_counter() - started


def export_rounds(work: str, width: int, rounds: int, timeout_s: float) -> dict[str, Any]:
    """Save once from :data:`RANKS` ranks, then ``rounds`` rounds of {cold export, cold cat}."""
    from ckpt.format.layout import checkpoint_dirname

    root = os.path.join(work, "ckpt")
    saved = run_on_ranks(save_checkpoint, RANKS, root, width, timeout_s=timeout_s)[0]
    ckpt_dir = os.path.join(root, checkpoint_dirname(SAVED_STEP))
    files = [p for p in disk.files_under(ckpt_dir) if p.endswith((".distcp", ".metadata"))]
    max_shard = max(1, saved["model_bytes"] // OUTPUT_SHARDS)
    exports: list[dict[str, Any]] = []
    cat_s: list[float] = []
    methods: set[str] = set()
    for i in range(rounds):
        for side in ("ours", "cat") if i % 2 == 0 else ("cat", "ours"):
            methods.add(disk.drop_page_cache(files))
            if side == "ours":
                out = os.path.join(work, f"export_{i}")
                exports.append(_export_once(root, out, max_shard, timeout_s))
                shutil.rmtree(out)
            else:
                cat_s.append(_cat(files))
    return {
        "exports": exports,
        "cat_s": cat_s,
        "cat_bytes": sum(os.path.getsize(p) for p in files),
        "model_bytes": saved["model_bytes"],
        "max_shard_size": max_shard,
        "cache_drop": sorted(methods),
    }


def export_metrics(raw: dict[str, Any]) -> list[Metric]:
    """export_memory and export_vs_read from :func:`export_rounds` (pure)."""
    exports = raw["exports"]
    largest = max(max(e["files"].values()) for e in exports)
    growth = [e["growth"] for e in exports]
    seconds = [e["seconds"] for e in exports]
    ours_bps = exports[-1]["bytes_read"] / statistics.median(seconds)
    cat_bps = raw["cat_bytes"] / statistics.median(raw["cat_s"])
    shared = {
        "model_bytes": raw["model_bytes"],
        "checkpoint_bytes": raw["cat_bytes"],
        "max_shard_size": raw["max_shard_size"],
        "cache_drop": raw["cache_drop"],
    }
    return [
        Metric(
            name="export_memory",
            value=round(statistics.median(growth) / largest, 4),
            detail={
                **shared,
                "peak_rss_growth_bytes": growth,
                "largest_output_file_bytes": largest,
                "peak_method": sorted({e["peak_method"] for e in exports}),
            },
        ),
        Metric(
            name="export_vs_read",
            value=round(ours_bps / cat_bps, 4),
            detail={
                **shared,
                "ours_MBps": round(ours_bps / 1e6, 1),
                "cat_MBps": round(cat_bps / 1e6, 1),
                "ours_samples_s": [round(s, 4) for s in seconds],
                "cat_samples_s": [round(s, 4) for s in raw["cat_s"]],
                "bytes_read": exports[-1]["bytes_read"],
                "bytes_written": exports[-1]["bytes_written"],
                "baseline": "cat of every shard file and .metadata to /dev/null, cold cache",
            },
        ),
    ]
