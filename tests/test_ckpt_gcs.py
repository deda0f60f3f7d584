"""ckpt on gs:// against the real fake-gcs-server emulator.

Round trip and object crc32c, the storage fault matrix, a rank killed before
COMPLETE, 2 -> 3 rank resharding through GCS, a corrupted object, a missing bucket
and the CLI. Emulator helpers and findings: bench/harness/gcs_emulator.py (fixtures in
tests/conftest.py), docs/gcs-emulator-notes.md.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time

import google_crc32c
import pytest
from test_ckpt_core import assert_state_equal, blank_state, make_state

import ckpt
from ckpt.errors import StoragePermanentError
from ckpt.storage import Storage, StorageOptions, faults
from ckpt.storage.faults import StorageFault
from testing.gcs_emulator import emulator_env, gcs_filesystem
from testing.spawn import run_ok, run_ranks

pytestmark = [pytest.mark.gcs, pytest.mark.timeout(120)]

FAST_RETRY = StorageOptions(backoff_initial_s=0.01, backoff_max_s=0.02)
MISSING_BUCKET_ROOT = "gs://no-such-bucket-xyz/run"


def gcs_crc(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def bucket_path(root: str) -> str:
    """``gs://bucket/prefix`` -> ``bucket/prefix`` (gcsfs paths have no scheme)."""
    return root.removeprefix("gs://")


def assert_loads(root: str, expected: dict) -> ckpt.LoadResult:
    loaded = blank_state()
    result = ckpt.load(loaded, root)
    assert_state_equal(loaded, expected)
    return result


# -- 1. round trip and object crc32c ------------------------------------------------


def test_round_trip_and_manifest_crc_matches_object_crc(gcs_root):
    state = make_state(7)
    url = ckpt.save(state, gcs_root, 7, metadata={"tokens_seen": 4096, "cursor": {"epoch": 2}})
    assert url == f"{gcs_root}/checkpoint_0000007"

    result = assert_loads(gcs_root, state)
    assert result.step == 7 and result.url == url
    assert result.metadata == {"tokens_seen": 4096, "cursor": {"epoch": 2}}
    assert result.bytes_read > 0

    fs = gcs_filesystem(requests_timeout=10)
    info = ckpt.find_latest_committed(gcs_root)
    assert {f.path for f in info.manifest.files} == {".metadata", "rank_00000.distcp"}
    for entry in info.manifest.files:
        path = f"{bucket_path(url)}/{entry.path}"
        meta = fs.info(path)
        assert meta["crc32c"] == entry.crc32c, entry.path  # what the emulator computed
        assert meta["size"] == entry.size
        assert gcs_crc(fs.cat_file(path)) == entry.crc32c  # and what the bytes say

    report = ckpt.verify_dir(Storage(gcs_root).child(info.dirname), info.manifest, deep=False)
    assert report.ok, report.problems
    assert report.crc_checked == len(info.manifest.files)  # object crc32c, no download
    assert report.bytes_checked == 0


def test_small_files_go_up_as_one_request_each_without_compose(gcs_root, monkeypatch):
    from ckpt.storage.gcs_parts import GcsClient

    uploads: list[str] = []
    composes: list[str] = []
    original = GcsClient.upload
    monkeypatch.setattr(
        GcsClient,
        "upload",
        lambda self, bucket, name, body: uploads.append(name) or original(self, bucket, name, body),
    )
    monkeypatch.setattr(GcsClient, "compose", lambda self, *a: composes.append(a[1]))
    ckpt.save(make_state(4), gcs_root, 4)
    names = sorted(name.rsplit("/", 1)[-1] for name in uploads)
    # ATTEMPT: the claim a save writes before its shards (ckpt.root.ownership), gone at commit
    assert names == sorted(
        [".metadata", "rank_00000.distcp", "manifest.json", "COMPLETE", "ATTEMPT"]
    )
    assert composes == []
    assert not Storage(gcs_root).exists("checkpoint_0000004/ATTEMPT")
    assert_loads(gcs_root, make_state(4))


# -- 2. fault matrix ----------------------------------------------------------------


@pytest.mark.parametrize("phase", ["shard", "metadata", "manifest", "complete"])
@pytest.mark.parametrize("kind", ["http429", "http503", "timeout", "reset", "truncate"])
def test_transient_fault_is_retried_and_commits(gcs_root, phase, kind):
    with faults.inject(StorageFault(phase=phase, kind=kind, times=2)) as armed:
        ckpt.save(make_state(3), gcs_root, 3, storage_options=FAST_RETRY)
    assert armed[0].fired == 2
    info = ckpt.find_latest_committed(gcs_root)
    assert info.step == 3
    report = ckpt.verify_dir(Storage(gcs_root).child(info.dirname), info.manifest, deep=True)
    assert report.ok, report.problems
    assert report.files_checked == len(info.manifest.files)
    assert_loads(gcs_root, make_state(3))


@pytest.mark.parametrize("phase", ["shard", "metadata", "manifest", "complete"])
def test_permanent_fault_fails_fast_and_keeps_previous(gcs_root, phase):
    first = make_state(1)
    ckpt.save(first, gcs_root, 1, storage_options=FAST_RETRY)
    # A large backoff: a retry of the permanent error would show in the time and the count.
    opts = StorageOptions(backoff_initial_s=2.0, backoff_max_s=5.0)
    started = time.monotonic()
    with (
        faults.inject(StorageFault(phase=phase, kind="permanent", times=3)) as armed,
        pytest.raises(ckpt.CheckpointError, match=r"403|not retried"),
    ):
        ckpt.save(make_state(2), gcs_root, 2, storage_options=opts)
    assert time.monotonic() - started < 5
    assert armed[0].fired == 1
    fs = gcs_filesystem(requests_timeout=10)
    assert not fs.exists(f"{bucket_path(gcs_root)}/checkpoint_0000002/COMPLETE")
    infos = {i.step: i for i in ckpt.list_checkpoints(gcs_root)}
    assert infos[1].committed and (2 not in infos or not infos[2].committed)
    assert ckpt.find_latest_committed(gcs_root).step == 1
    result = assert_loads(gcs_root, first)
    assert result.step == 1 and result.skipped == []


def save_step_2_worker(rank: int, world: int, root: str) -> str:
    ckpt.save(make_state(2), root, 2)
    return "saved"


@pytest.mark.parametrize("fault", ["manifest:kill:rank=0", "complete:kill:rank=0"])
def test_killed_before_complete_leaves_previous_newest(gcs_emulator, gcs_root, fault):
    first = make_state(1)
    ckpt.save(first, gcs_root, 1)
    env = {**emulator_env(gcs_emulator.endpoint), faults.ENV_STORAGE_FAULTS: fault}
    outcomes = run_ranks(save_step_2_worker, 1, gcs_root, timeout_s=60, env=env)
    assert outcomes[0].exitcode == -9, outcomes[0].error  # SIGKILL inside the storage call
    fs = gcs_filesystem(requests_timeout=10)
    step2 = f"{bucket_path(gcs_root)}/checkpoint_0000002"
    assert fs.exists(f"{step2}/rank_00000.distcp")  # it did get past the shards
    assert not fs.exists(f"{step2}/COMPLETE")
    infos = {i.step: i for i in ckpt.list_checkpoints(gcs_root)}
    assert infos[1].committed and not infos[2].committed
    assert assert_loads(gcs_root, first).step == 1


# -- 3. FSDP2 on 2 ranks -> 3 ranks through GCS ---------------------------------------


def fsdp_save_worker(rank: int, world: int, root: str) -> dict | None:
    from test_ckpt_distributed import build, full_state, sharded_state, train_steps

    model, optim = build(seed=11)
    train_steps(model, optim, 3, rank)
    ckpt.save(sharded_state(model, optim, 30), root, 30, metadata={"world": world})
    full = full_state(model, optim)
    return full if rank == 0 else None


def fsdp_load_worker(rank: int, world: int, root: str) -> dict:
    from test_ckpt_distributed import build, full_state, sharded_state, train_steps
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, optim = build(seed=999)  # other init: every value must come from the checkpoint
    train_steps(model, optim, 1, rank)  # materialize the optimizer state
    state = sharded_state(model, optim, step=-1)
    result = ckpt.load(state, root)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = full_state(model, optim)  # collective
    return {
        "step": result.step,
        "step_value": state["step"],
        "saved_world": result.manifest.world_size,
        "metadata": result.metadata,
        "full": full if rank == 0 else None,
    }


def assert_fsdp2_reshards(root: str, env: dict[str, str], load_world: int) -> None:
    """FSDP2 state saved on 2 ranks under ``root`` loads, every value equal, on
    ``load_world`` ranks."""
    from test_ckpt_distributed import assert_full_equal

    original = run_ok(fsdp_save_worker, 2, root, timeout_s=120, env=env)[0]
    info = ckpt.find_latest_committed(root)
    assert info.step == 30 and info.manifest.world_size == 2
    assert {"rank_00000.distcp", "rank_00001.distcp"} <= {f.path for f in info.manifest.files}

    loaded = run_ok(fsdp_load_worker, load_world, root, timeout_s=120, env=env)
    for out in loaded:
        assert out["step"] == 30 and out["step_value"] == 30
        assert out["saved_world"] == 2 and out["metadata"] == {"world": 2}
    assert_full_equal(original, loaded[0]["full"])


@pytest.mark.timeout(300)
def test_fsdp2_save_on_2_ranks_load_on_3(gcs_emulator, gcs_root):
    assert_fsdp2_reshards(gcs_root, emulator_env(gcs_emulator.endpoint), 3)


# -- 4. a corrupted object -------------------------------------------------------------


def test_flipped_byte_fails_fast_verify_and_load_falls_back(gcs_root, monkeypatch):
    good = make_state(1)
    ckpt.save(good, gcs_root, 1)
    ckpt.save(make_state(2), gcs_root, 2)
    fs = gcs_filesystem(requests_timeout=10)
    shard = f"{bucket_path(gcs_root)}/checkpoint_0000002/rank_00000.distcp"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(shard, bytes(data))  # same size: only the crc32c can tell
    assert fs.info(shard)["size"] == len(data)

    info = ckpt.find_latest_committed(gcs_root)
    assert info.step == 2
    storage = Storage(gcs_root).child(info.dirname)

    def no_download(*args, **kwargs):
        raise AssertionError("fast verify must not read object bytes")

    with monkeypatch.context() as patch:
        patch.setattr(Storage, "read_range", no_download)
        patch.setattr(Storage, "read_bytes", no_download)
        fast = ckpt.verify_dir(storage, info.manifest, deep=False)
    assert not fast.ok
    assert [p for p, _ in fast.problems] == ["rank_00000.distcp"]
    assert "crc32c" in fast.problems[0][1] and fast.bytes_checked == 0
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"rank_00000\.distcp") as err:
        fast.raise_if_bad()
    assert err.value.path == "rank_00000.distcp"

    events: list[dict] = []
    loaded = blank_state()
    result = ckpt.load(loaded, gcs_root, on_event=events.append)
    assert result.step == 1
    assert_state_equal(loaded, good)
    assert [(s.step, s.path) for s in result.skipped] == [(2, "rank_00000.distcp")]
    fallback = [e for e in events if e["event"] == "ckpt_fallback"]
    assert len(fallback) == 1
    assert fallback[0]["step"] == 2 and fallback[0]["path"] == "rank_00000.distcp"
    assert "rank_00000.distcp" in fallback[0]["reason"] and "crc32c" in fallback[0]["reason"]


# -- 5. missing bucket -------------------------------------------------------------------


def test_missing_bucket_save_and_load_fail_fast_and_clearly(gcs_emulator):
    started = time.monotonic()
    with pytest.raises(ckpt.CheckpointError, match=MISSING_BUCKET_ROOT) as err:
        ckpt.save(make_state(1), MISSING_BUCKET_ROOT, 1)
    assert time.monotonic() - started < 10
    assert "not found" in str(err.value)

    # A missing bucket is not an empty root: even with missing_ok, load must not
    # return None (the trainer would silently start from scratch on a typo).
    for missing_ok in (False, True):
        started = time.monotonic()
        with pytest.raises(StoragePermanentError, match="bucket 'no-such-bucket") as err:
            ckpt.load(blank_state(), MISSING_BUCKET_ROOT, missing_ok=missing_ok)
        assert MISSING_BUCKET_ROOT in str(err.value)
        assert time.monotonic() - started < 10


def test_empty_existing_bucket_is_a_fresh_start(gcs_root):
    assert ckpt.load(blank_state(), gcs_root, missing_ok=True) is None


def missing_bucket_worker(rank: int, world: int, root: str) -> dict:
    started = time.monotonic()
    try:
        ckpt.save(make_state(rank), root, 1)
    except Exception as exc:
        return {
            "is_ckpt_error": isinstance(exc, ckpt.CheckpointError),
            "type": type(exc).__name__,
            "message": str(exc),
            "elapsed": time.monotonic() - started,
        }
    return {"is_ckpt_error": False, "type": "", "message": "saved", "elapsed": 0.0}


@pytest.mark.timeout(180)
def test_missing_bucket_every_rank_raises(gcs_emulator):
    env = {**emulator_env(gcs_emulator.endpoint), "CKPT_COLLECTIVE_TIMEOUT_S": "30"}
    results = run_ok(missing_bucket_worker, 2, MISSING_BUCKET_ROOT, timeout_s=120, env=env)
    for rank, out in enumerate(results):
        assert out["is_ckpt_error"], (rank, out)
        assert MISSING_BUCKET_ROOT in out["message"], (rank, out)
        assert "not found" in out["message"], (rank, out)
        assert out["elapsed"] < 10, (rank, out)


# -- 6. CLI --------------------------------------------------------------------------------


def run_cli(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **emulator_env(endpoint)}
    return subprocess.run(
        [sys.executable, "-m", "ckpt", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(300)
def test_cli_ls_and_verify_exit_codes(gcs_emulator, gcs_root):
    ckpt.save(make_state(1), gcs_root, 1)
    ckpt.save(make_state(2), gcs_root, 2)

    ls = run_cli(gcs_emulator.endpoint, "ls", gcs_root)
    assert ls.returncode == 0, ls.stderr
    assert "2 committed, 0 partial" in ls.stdout
    assert f"{gcs_root}" in ls.stdout

    ok = run_cli(gcs_emulator.endpoint, "verify", gcs_root)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith("OK") and "checkpoint_0000002" in ok.stdout
    assert "2 crc32c checked" in ok.stdout

    fs = gcs_filesystem(requests_timeout=10)
    shard = f"{bucket_path(gcs_root)}/checkpoint_0000002/rank_00000.distcp"
    data = bytearray(fs.cat_file(shard))
    data[0] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    bad = run_cli(gcs_emulator.endpoint, "verify", gcs_root)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert bad.stdout.startswith("FAIL") and "rank_00000.distcp" in bad.stdout
    assert "crc32c" in bad.stdout
