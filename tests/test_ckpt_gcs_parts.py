"""GCS parallel part uploads, compose and parallel ranged reads (ckpt.storage.gcs_parts).

The part sink alone (zero-copy, part cuts, crc32c per part), then on the
fake-gcs-server emulator: multi-part round trips (one and two compose levels),
a part failing N times, a corrupted part caught by the composed crc32c (and the
lifecycle policy acting on it), the emulator frozen mid-compose, a process killed
mid-upload whose parts ``python -m ckpt gc`` collects, and parallel ranged reads.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import ckpt
from ckpt.errors import ObjectNotFoundError
from ckpt.format.checksum import crc32c_of, encode_crc32c
from ckpt.format.layout import parse_checkpoint_dirname
from ckpt.storage import Storage, StorageOptions, faults
from ckpt.storage.faults import StorageFault
from ckpt.storage.gcs_parts import (
    PARTS_DIRNAME,
    GcsClient,
    GcsTransferOptions,
    PartSink,
    is_part_key,
    part_crc,
    part_key,
)
from testing.gcs_emulator import (
    EMULATOR_HOST_ENV,
    create_bucket,
    gcs_filesystem,
    start_emulator,
)

PART = 256 << 10
PARTS = GcsTransferOptions(parallel_min_bytes=0, part_bytes=PART, workers=3)
FAST = dict(backoff_initial_s=0.01, backoff_max_s=0.02)


def options(**kw) -> StorageOptions:
    return StorageOptions(**{**FAST, "gcs": PARTS, **kw})


def big_state(seed: int, rows: int = 640) -> dict:
    """~1.6 MB of tensors: several 256 KiB parts per shard."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(rows, 512, generator=gen),
        "v": torch.randn(rows, 128, generator=gen),
        "step": seed,
    }


def blank(rows: int = 640) -> dict:
    return {"w": torch.zeros(rows, 512), "v": torch.zeros(rows, 128), "step": -1}


def assert_same(a: dict, b: dict) -> None:
    assert torch.equal(a["w"], b["w"]) and torch.equal(a["v"], b["v"])
    assert a["step"] == b["step"]


def objects(fs, root: str) -> list[str]:
    fs.invalidate_cache()
    try:
        return sorted(fs.find(root.removeprefix("gs://")))
    except FileNotFoundError:
        return []


def part_objects(fs, root: str) -> list[str]:
    return [o for o in objects(fs, root) if f"/{PARTS_DIRNAME}/" in o]


# -- 1. the sink, no storage -------------------------------------------------------


def test_sink_cuts_parts_of_exact_size_and_holds_large_buffers_without_copy():
    handed: list[int] = []
    sink = PartSink(100, 0, lambda index, part: handed.append(index))
    big = bytearray(os.urandom(250 << 10))
    sink.write(b"head")  # small: copied
    sink.write(memoryview(big))  # large: held
    parts = sink.close()
    data = b"head" + bytes(big)
    assert [p.size for p in parts] == [100] * (len(data) // 100) + [len(data) % 100]
    assert b"".join(bytes(b) for p in parts for b in p.buffers) == data
    for p in parts:
        assert encode_crc32c(part_crc(p)) == crc32c_of(b"".join(bytes(b) for b in p.buffers))
    # zero-copy: changing the source shows through the held views
    big[-1] ^= 0xFF
    assert bytes(parts[-1].buffers[-1])[-1] == big[-1]
    # every full part but the open last one was handed off, in order
    assert handed == list(range(len(parts) - 1))


def test_sink_keeps_an_object_under_the_threshold_in_one_part():
    handed: list[int] = []
    sink = PartSink(100, 1000, lambda index, part: handed.append(index))
    sink.write(os.urandom(700 << 0))
    parts = sink.close()
    assert handed == [] and len(parts) == 1 and parts[0].size == 700


def test_part_names_are_ignored_by_discovery_and_recognised_as_parts():
    key = part_key("rank_00000.distcp", "abc", 3)
    assert key == f"{PARTS_DIRNAME}/rank_00000.distcp.abc.00003"
    assert is_part_key(key) and not is_part_key("rank_00000.distcp")
    assert parse_checkpoint_dirname(PARTS_DIRNAME) is None


def test_transfer_options_are_validated():
    with pytest.raises(ValueError, match="part_bytes"):
        GcsTransferOptions(part_bytes=0)
    with pytest.raises(ValueError, match="workers"):
        GcsTransferOptions(workers=0)


# -- 2. on the emulator ------------------------------------------------------------


@pytest.mark.gcs
@pytest.mark.timeout(120)
@pytest.mark.parametrize("part_bytes", [PART, 32 << 10], ids=["one-compose", "two-levels"])
def test_multi_part_save_composes_and_leaves_no_parts(gcs_root, monkeypatch, part_bytes):
    calls: list[int] = []
    original = GcsClient.compose

    def counting(self, bucket, name, sources):
        calls.append(len(sources))
        return original(self, bucket, name, sources)

    monkeypatch.setattr(GcsClient, "compose", counting)
    gcs = GcsTransferOptions(parallel_min_bytes=0, part_bytes=part_bytes, workers=3)
    state = big_state(5)
    ckpt.save(state, gcs_root, 5, storage_options=options(gcs=gcs))
    assert calls and max(calls) <= 32
    if part_bytes < PART:  # > 32 parts: composed in two levels
        assert len(calls) > 1
    fs = gcs_filesystem(requests_timeout=10)
    assert part_objects(fs, gcs_root) == []
    info = ckpt.find_latest_committed(gcs_root)
    for entry in info.manifest.files:
        meta = fs.info(f"{gcs_root.removeprefix('gs://')}/{info.dirname}/{entry.path}")
        assert (meta["crc32c"], meta["size"]) == (entry.crc32c, entry.size)
    loaded = blank()
    ckpt.load(loaded, gcs_root)
    assert_same(loaded, state)


@pytest.mark.gcs
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["http503", "reset", "truncate"])
def test_a_part_failing_n_times_is_retried_alone_and_commits(gcs_root, kind):
    state = big_state(6)
    with faults.inject(StorageFault(phase="shard", kind=kind, times=3)) as armed:
        ckpt.save(state, gcs_root, 6, storage_options=options())
    assert armed[0].fired == 3
    info = ckpt.find_latest_committed(gcs_root)
    report = ckpt.verify_dir(Storage(gcs_root).child(info.dirname), info.manifest, deep=True)
    assert report.ok, report.problems
    assert part_objects(gcs_filesystem(requests_timeout=10), gcs_root) == []
    loaded = blank()
    ckpt.load(loaded, gcs_root)
    assert_same(loaded, state)


@pytest.mark.gcs
@pytest.mark.timeout(120)
def test_a_part_failing_for_good_fails_the_save_fast_and_removes_the_parts(gcs_root):
    first = big_state(1)
    ckpt.save(first, gcs_root, 1, storage_options=options())
    slow_backoff = options(backoff_initial_s=2.0, backoff_max_s=5.0)
    started = time.monotonic()
    with (
        faults.inject(StorageFault(phase="shard", kind="permanent", times=1)) as armed,
        pytest.raises(ckpt.CheckpointError, match=r"403|not retried"),
    ):
        ckpt.save(big_state(2), gcs_root, 2, storage_options=slow_backoff)
    assert time.monotonic() - started < 5  # not retried
    assert armed[0].fired == 1
    assert part_objects(gcs_filesystem(requests_timeout=10), gcs_root) == []
    assert ckpt.find_latest_committed(gcs_root).step == 1


def _corrupting_compose(monkeypatch, armed: list[bool]) -> None:
    """Flip one byte of the first part between its upload and the compose."""
    original = GcsClient.compose

    def corrupting(self, bucket, name, sources):
        if armed[0]:
            fs = gcs_filesystem(requests_timeout=10)
            path = f"{bucket}/{sources[0]}"
            data = bytearray(fs.cat_file(path))
            data[len(data) // 2] ^= 0x01
            fs.pipe_file(path, bytes(data))
        return original(self, bucket, name, sources)

    monkeypatch.setattr(GcsClient, "compose", corrupting)


@pytest.mark.gcs
@pytest.mark.timeout(120)
def test_a_part_corrupted_before_compose_fails_the_save_and_keeps_the_previous(
    gcs_root, monkeypatch
):
    first = big_state(1)
    ckpt.save(first, gcs_root, 1, storage_options=options())
    _corrupting_compose(monkeypatch, [True])
    with pytest.raises(ckpt.CheckpointError, match=r"composed object .* crc32c"):
        ckpt.save(big_state(2), gcs_root, 2, storage_options=options())
    fs = gcs_filesystem(requests_timeout=10)
    assert not any(o.endswith("checkpoint_0000002/COMPLETE") for o in objects(fs, gcs_root))
    assert part_objects(fs, gcs_root) == []
    assert ckpt.find_latest_committed(gcs_root).step == 1
    loaded = blank()
    ckpt.load(loaded, gcs_root)
    assert_same(loaded, first)


@pytest.mark.gcs
@pytest.mark.timeout(120)
def test_corrupted_uploads_count_as_failed_saves_for_the_lifecycle_policy(gcs_root, monkeypatch):
    armed = [False]
    _corrupting_compose(monkeypatch, armed)
    state = big_state(1)
    manager = ckpt.CheckpointManager(
        gcs_root, state, max_failures=2, rng=False, storage_options=options()
    )
    assert manager.save(1) is not None
    armed[0] = True
    assert manager.save(2) is None  # failed: training goes on
    with pytest.raises(ckpt.TooManySaveFailuresError):
        manager.save(3)  # the second in a row: the job stops
    manager.close()
    assert ckpt.find_latest_committed(gcs_root).step == 1


@pytest.mark.gcs
@pytest.mark.timeout(120)
def test_emulator_frozen_mid_compose_fails_the_save_within_its_timeouts(gcs_emulator, monkeypatch):
    own = start_emulator()
    try:
        monkeypatch.setenv(EMULATOR_HOST_ENV, own.endpoint)
        create_bucket(own.endpoint, "frozen-compose")
        root = "gs://frozen-compose/ckpt"
        first = big_state(1)
        ckpt.save(first, root, 1, storage_options=options())
        original = GcsClient.compose
        frozen: list[float] = []

        def freezing(self, bucket, name, sources):
            if not frozen:
                own.pause()  # stays frozen for the retry and the clean-up too
            frozen.append(time.monotonic())
            return original(self, bucket, name, sources)

        monkeypatch.setattr(GcsClient, "compose", freezing)
        bounded = options(timeout_s=1.0, retry_attempts=2, retry_total_s=5.0)
        started = time.monotonic()
        with pytest.raises(ckpt.CheckpointError, match=r"compose|no answer|timed out"):
            ckpt.save(big_state(2), root, 2, storage_options=bounded)
        assert time.monotonic() - started < 60
        assert len(frozen) == 2  # one compose per attempt, each given up after 1 s
        own.resume()
        monkeypatch.setattr(GcsClient, "compose", original)
        assert ckpt.find_latest_committed(root).step == 1
        loaded = blank()
        ckpt.load(loaded, root)
        assert_same(loaded, first)
    finally:
        own.stop()


KILLED_UPLOAD = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import ckpt
    from ckpt.storage.gcs_parts import GcsClient, GcsTransferOptions
    from ckpt.storage import StorageOptions

    original = GcsClient.upload
    seen = []

    def dying(self, bucket, name, body):
        out = original(self, bucket, name, body)
        if "/.parts/" in name:
            seen.append(name)
            if len(seen) == 2:  # two parts are up: crash before the compose
                os.kill(os.getpid(), signal.SIGKILL)
        return out

    GcsClient.upload = dying
    gcs = GcsTransferOptions(parallel_min_bytes=0, part_bytes=256 << 10, workers=1)
    state = {"w": torch.randn(640, 512), "v": torch.randn(640, 128), "step": 2}
    ckpt.save(state, sys.argv[1], 2, storage_options=StorageOptions(gcs=gcs))
    """
)


@pytest.mark.gcs
@pytest.mark.timeout(180)
def test_killed_upload_leaves_no_complete_and_gc_collects_its_parts(gcs_root, tmp_path):
    ckpt.save(big_state(1), gcs_root, 1, storage_options=options())
    script = tmp_path / "killed.py"
    script.write_text(KILLED_UPLOAD)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, str(script), gcs_root], env=env, timeout=120, capture_output=True
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    fs = gcs_filesystem(requests_timeout=10)
    left = part_objects(fs, gcs_root)
    assert left and all("/checkpoint_0000002/.parts/" in o for o in left)
    assert not any(o.endswith("checkpoint_0000002/COMPLETE") for o in objects(fs, gcs_root))
    infos = {i.step: i for i in ckpt.list_checkpoints(gcs_root)}
    assert infos[1].committed and not infos[2].committed
    assert ckpt.find_latest_committed(gcs_root).step == 1

    # A later commit makes step 2 a dead attempt: gc deletes it, parts included.
    ckpt.save(big_state(3), gcs_root, 3, storage_options=options(), retention=None)
    assert part_objects(fs, gcs_root) == left  # still there until gc
    gc = subprocess.run(
        [sys.executable, "-m", "ckpt", "gc", gcs_root, "--keep-last", "5"],
        env=env, timeout=120, capture_output=True, text=True,
    )  # fmt: skip
    assert gc.returncode == 0, gc.stderr
    assert re.search(r"deleted\s+step\s+2\b", gc.stdout), gc.stdout
    assert part_objects(fs, gcs_root) == []
    assert ckpt.find_latest_committed(gcs_root).step == 3


@pytest.mark.gcs
@pytest.mark.timeout(120)
def test_large_ranged_reads_go_in_parallel_parts_and_return_the_exact_bytes(gcs_root, monkeypatch):
    data = os.urandom(5 << 20) + b"tail"
    fs = gcs_filesystem(requests_timeout=10)
    fs.pipe_file(f"{gcs_root.removeprefix('gs://')}/blob", data)
    ranges: list[tuple[int, int]] = []
    original = GcsClient.read_into

    def recording(self, bucket, name, start, into):
        ranges.append((start, start + into.nbytes))
        return original(self, bucket, name, start, into)

    monkeypatch.setattr(GcsClient, "read_into", recording)
    gcs = GcsTransferOptions(read_part_bytes=1 << 20, workers=3)
    storage = Storage(gcs_root, StorageOptions(gcs=gcs))
    got = storage.read_range("blob", 1000, len(data) - 1)
    assert bytes(got) == data[1000:-1]
    assert len(ranges) == 5 and sorted(ranges)[0] == (1000, 1000 + (1 << 20))
    assert bytes(storage.read_range("blob", 7, 9)) == data[7:9]
    with pytest.raises(ObjectNotFoundError):
        storage.read_range("missing", 0, 10)


@pytest.mark.gcs
@pytest.mark.timeout(120)
def test_load_reads_spans_in_flight_into_recycled_buffers(gcs_root, monkeypatch):
    state = {
        "small": torch.arange(100, dtype=torch.int32),
        "w": torch.randn(640, 512),
        "v": torch.randn(100, 128),
        "step": 9,
    }
    monkeypatch.setenv("CKPT_SAVE_BLOCK_BYTES", str(64 << 10))  # w: 20 items of 64 KiB
    ckpt.save(state, gcs_root, 9)
    targets: list[int] = []
    original = GcsClient.read_into

    def recording(self, bucket, name, start, into):
        targets.append(id(into.obj))
        return original(self, bucket, name, start, into)

    monkeypatch.setattr(GcsClient, "read_into", recording)
    gcs = GcsTransferOptions(read_part_bytes=128 << 10, workers=3)
    loaded = {
        "small": torch.zeros(100, dtype=torch.int32),
        "w": torch.zeros(640, 512),
        "v": torch.zeros(100, 128),
        "step": -1,
    }
    result = ckpt.load(loaded, gcs_root, storage_options=StorageOptions(gcs=gcs))
    for key in ("small", "w", "v"):
        assert torch.equal(loaded[key], state[key]), key
    assert loaded["step"] == 9
    assert len(targets) >= 15  # many spans (one request each) ...
    assert len(set(targets)) <= 2 * 3 + 2  # ... into a few buffers, reused
    assert result.bytes_read >= 640 * 512 * 4
