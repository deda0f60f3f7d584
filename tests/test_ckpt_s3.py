"""ckpt on s3:// against a real S3 server process (moto, bench/harness/s3_server.py).

The contract the GCS backend meets, on S3's terms: round trip with the manifest's
crc32c equal to the CRC32C S3 keeps for each object; commit last with no rename or
copy; the storage fault matrix, and S3's own error answers (503 SlowDown, 500, 400
RequestTimeout, 403) from the wire; multipart uploads of large shards checked by S3's
full-object CRC32C, a part retried alone; a server frozen and one killed mid-save;
2 -> 1 rank resharding; a corrupted object; a missing bucket. Fixtures in
tests/conftest.py (``s3_server``, ``s3_root``); findings: docs/s3-server-notes.md.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_ckpt_core import assert_state_equal, blank_state, make_state
from test_ckpt_gcs import (
    assert_fsdp2_reshards,
    assert_loads,
    save_step_2_worker,
)
from test_ckpt_gcs import (
    test_transient_fault_is_retried_and_commits as transient_fault_is_retried_and_commits,
)

import ckpt
from ckpt.errors import ObjectNotFoundError, StoragePermanentError
from ckpt.format.checksum import crc32c_of
from ckpt.storage import Storage, StorageOptions, faults
from ckpt.storage.faults import StorageFault
from ckpt.storage.s3 import S3Client, S3TransferOptions
from testing.s3_server import S3Server, s3_env, start_s3_server
from testing.spawn import run_ranks

pytestmark = [pytest.mark.s3, pytest.mark.timeout(180)]

MIB = 1 << 20
FAST = {"backoff_initial_s": 0.01, "backoff_max_s": 0.02}
PARTS = S3TransferOptions(parallel_min_bytes=5 * MIB, part_bytes=5 * MIB, workers=3)
"""Objects above 5 MiB as 5 MiB parts (S3's smallest), 3 in flight."""
MISSING_BUCKET_ROOT = "s3://no-such-bucket-xyz/run"


def split_root(root: str) -> tuple[str, str]:
    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    return bucket, prefix


def held(server: S3Server, root: str, key: str) -> dict:
    """What S3 keeps for an object: size and CRC32C (HeadObject, ChecksumMode=ENABLED)."""
    bucket, prefix = split_root(root)
    return server.client().head_object(Bucket=bucket, Key=f"{prefix}/{key}", ChecksumMode="ENABLED")


def requests_under(server: S3Server, root: str, dirname: str) -> list[dict]:
    bucket, prefix = split_root(root)
    return [r for r in server.requests() if r["path"].startswith(f"/{bucket}/{prefix}/{dirname}/")]


def uploads_in_progress(server: S3Server, root: str) -> list[dict]:
    return server.client().list_multipart_uploads(Bucket=split_root(root)[0]).get("Uploads", [])


def large_state(seed: int) -> dict:
    """~13 MiB of tensors: a shard of three 5 MiB parts."""
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1600, 2048, generator=gen), "step": seed}


def blank_large() -> dict:
    return {"w": torch.zeros(1600, 2048), "step": -1}


def options(**kw) -> StorageOptions:
    return StorageOptions(**{**FAST, **kw})


# -- 1. round trip, S3's CRC32C, commit last -----------------------------------------------


def test_manifest_crc_is_the_crc32c_s3_keeps_and_verify_reads_no_bytes(
    s3_server, s3_root, monkeypatch
):
    state = make_state(7)
    url = ckpt.save(state, s3_root, 7, metadata={"tokens_seen": 4096})
    assert url == f"{s3_root}/checkpoint_0000007"
    result = assert_loads(s3_root, state)
    assert result.step == 7 and result.metadata == {"tokens_seen": 4096}

    info = ckpt.find_latest_committed(s3_root)
    assert {f.path for f in info.manifest.files} == {".metadata", "rank_00000.distcp"}
    bucket, prefix = split_root(s3_root)
    for entry in info.manifest.files:
        head = held(s3_server, s3_root, f"{info.dirname}/{entry.path}")
        assert head["ChecksumCRC32C"] == entry.crc32c, entry.path
        assert head["ContentLength"] == entry.size
        body = s3_server.client().get_object(
            Bucket=bucket, Key=f"{prefix}/{info.dirname}/{entry.path}"
        )
        assert crc32c_of(body["Body"].read()) == entry.crc32c  # and what the bytes say

    def no_download(*args, **kwargs):
        raise AssertionError("checking S3's checksums must not read object bytes")

    monkeypatch.setattr(Storage, "read_range", no_download)
    report = ckpt.verify_dir(Storage(s3_root).child(info.dirname), info.manifest, mode="checksum")
    assert report.ok, report.problems
    assert report.crc_checked == len(info.manifest.files) and report.bytes_checked == 0


def test_a_save_puts_each_object_once_commits_last_and_renames_nothing(s3_server, s3_root):
    s3_server.reset()
    ckpt.save(make_state(4), s3_root, 4)
    sent = requests_under(s3_server, s3_root, "checkpoint_0000004")
    puts = [r["path"].rsplit("/", 1)[-1] for r in sent if r["method"] == "PUT"]
    assert sorted(puts) == sorted(
        ["ATTEMPT", ".metadata", "rank_00000.distcp", "manifest.json", "COMPLETE"]
    )
    assert puts[0] == "ATTEMPT" and puts[-1] == "COMPLETE"  # the claim first, the commit last
    assert not [r for r in s3_server.requests() if r["copy"]]  # no copy: nothing renamed
    assert not [r for r in sent if r["method"] == "POST"]  # small objects: no multipart
    deletes = [r["path"].rsplit("/", 1)[-1] for r in sent if r["method"] == "DELETE"]
    assert deletes == ["ATTEMPT"]  # gone once committed
    last_put = max(i for i, r in enumerate(sent) if r["method"] == "PUT")
    assert sent[last_put]["path"].endswith("/COMPLETE")
    assert next(i for i, r in enumerate(sent) if r["method"] == "DELETE") > last_put
    assert not Storage(s3_root).exists("checkpoint_0000004/ATTEMPT")
    assert_loads(s3_root, make_state(4))


# -- 2. faults: planned in the client, and answered by the server ------------------------


@pytest.mark.parametrize("phase", ["shard", "metadata", "manifest", "complete"])
@pytest.mark.parametrize("kind", ["http429", "http503", "timeout", "reset", "truncate"])
def test_a_transient_fault_is_retried_and_the_save_commits(s3_root, phase, kind):
    transient_fault_is_retried_and_commits(s3_root, phase, kind)


@pytest.mark.parametrize(
    ("status", "code", "where"),
    [
        (503, "SlowDown", "PUT rank_00000.distcp"),
        (500, "InternalError", "PUT manifest.json"),
        (400, "RequestTimeout", "PUT COMPLETE"),
        (503, "SlowDown", "GET rank_00000.distcp"),
        (500, "InternalError", "GET list-type=2"),
    ],
)
def test_s3_error_answers_that_s3_calls_retryable_are_retried(
    s3_server, s3_root, status, code, where
):
    s3_server.reset()
    s3_server.inject(status, code, where, times=2)
    state = make_state(5)
    ckpt.save(state, s3_root, 5, storage_options=options())
    loaded = blank_state()
    assert ckpt.load(loaded, s3_root, storage_options=options()).step == 5
    assert_state_equal(loaded, state)
    assert s3_server.fired() == 2


def test_access_denied_from_s3_fails_the_save_at_once_and_keeps_the_previous(s3_server, s3_root):
    ckpt.save(make_state(1), s3_root, 1)
    s3_server.reset()
    s3_server.inject(403, "AccessDenied", "PUT rank_0", times=5)
    started = time.monotonic()
    slow_backoff = StorageOptions(backoff_initial_s=2.0, backoff_max_s=5.0)
    with pytest.raises(ckpt.CheckpointError, match=r"AccessDenied.*not retried|not retried"):
        ckpt.save(make_state(2), s3_root, 2, storage_options=slow_backoff)
    assert s3_server.fired() == 1  # armed 5 times: a retry would have fired again
    assert time.monotonic() - started < 30
    s3_server.reset()
    assert ckpt.find_latest_committed(s3_root).step == 1
    assert not Storage(s3_root).exists("checkpoint_0000002/COMPLETE")
    assert_loads(s3_root, make_state(1))


# -- 3. multipart uploads -------------------------------------------------------------


def test_a_large_shard_goes_up_in_parallel_parts_checked_by_s3s_full_object_crc32c(
    s3_server, s3_root
):
    s3_server.reset()
    state = large_state(3)
    ckpt.save(state, s3_root, 3, storage_options=options(transfer=PARTS))
    sent = requests_under(s3_server, s3_root, "checkpoint_0000003")
    shard = [r for r in sent if r["path"].endswith("/rank_00000.distcp")]
    assert next(r["query"] for r in shard if r["method"] == "POST") == "uploads"  # started
    part_puts = [r for r in shard if r["method"] == "PUT" and "partNumber=" in r["query"]]
    assert len(part_puts) == 3
    assert [r for r in shard if r["method"] == "POST" and "uploadId=" in r["query"]]  # completed
    assert not [r for r in shard if r["method"] == "PUT" and not r["query"]]  # no single PUT

    info = ckpt.find_latest_committed(s3_root)
    entry = info.manifest.file("rank_00000.distcp")
    head = held(s3_server, s3_root, f"{info.dirname}/rank_00000.distcp")
    assert head["ChecksumType"] == "FULL_OBJECT"  # S3 combined the parts' CRC32C
    assert (head["ChecksumCRC32C"], head["ContentLength"]) == (entry.crc32c, entry.size)
    assert uploads_in_progress(s3_server, s3_root) == []
    loaded = blank_large()
    ckpt.load(loaded, s3_root, storage_options=options(transfer=PARTS))
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3


@pytest.mark.parametrize("kind", ["http503", "reset", "truncate"])
def test_a_part_failing_n_times_is_retried_alone_and_the_save_commits(s3_server, s3_root, kind):
    s3_server.reset()
    state = large_state(6)
    with faults.inject(StorageFault(phase="shard", kind=kind, times=3)) as armed:
        ckpt.save(state, s3_root, 6, storage_options=options(transfer=PARTS))
    assert armed[0].fired == 3
    sent = requests_under(s3_server, s3_root, "checkpoint_0000006")
    part_puts = [r for r in sent if r["method"] == "PUT" and "partNumber=" in r["query"]]
    # an injected error fails before the request; a cut body is sent, caught, sent again
    assert len(part_puts) == 3 + (3 if kind == "truncate" else 0)
    assert len([r for r in sent if r["query"] == "uploads"]) == 1  # one upload, not restarted
    assert uploads_in_progress(s3_server, s3_root) == []
    loaded = blank_large()
    ckpt.load(loaded, s3_root)
    assert torch.equal(loaded["w"], state["w"])


def test_a_part_failing_for_good_aborts_the_upload_and_keeps_the_previous(s3_server, s3_root):
    ckpt.save(large_state(1), s3_root, 1, storage_options=options(transfer=PARTS))
    s3_server.reset()
    s3_server.inject(403, "AccessDenied", "PUT partNumber=2")
    with pytest.raises(ckpt.CheckpointError, match="AccessDenied"):
        ckpt.save(large_state(2), s3_root, 2, storage_options=options(transfer=PARTS))
    assert s3_server.fired() == 1
    aborted = [
        r for r in s3_server.requests() if r["method"] == "DELETE" and "uploadId=" in r["query"]
    ]
    assert len(aborted) == 1
    assert uploads_in_progress(s3_server, s3_root) == []
    assert ckpt.find_latest_committed(s3_root).step == 1


# -- 4. outages: a frozen server, a killed one -------------------------------------------


def test_a_server_stopped_mid_save_fails_the_save_cleanly_and_a_restarted_one_takes_the_next(
    monkeypatch,
):
    own = start_s3_server()
    try:
        own.create_bucket("outage")
        root = "s3://outage/ckpt"
        bounded = options(
            timeout_s=2.0,
            retry_attempts=2,
            retry_total_s=6.0,
            fs_kwargs={"endpoint_url": own.endpoint},
        )
        ckpt.save(make_state(1), root, 1, storage_options=bounded)
        original = S3Client.put
        outage = {"kind": "pause"}

        def failing_put(self, bucket, key, body, crc):
            if key.endswith(".distcp") and outage["kind"]:
                own.pause() if outage["kind"] == "pause" else own.kill()
                outage["kind"] = ""
            return original(self, bucket, key, body, crc)

        monkeypatch.setattr(S3Client, "put", failing_put)
        started = time.monotonic()
        with pytest.raises(ckpt.CheckpointError, match=r"no answer|timed out|Timeout"):
            ckpt.save(make_state(2), root, 2, storage_options=bounded)
        assert time.monotonic() - started < 60
        own.resume()
        assert ckpt.find_latest_committed(Storage(root, bounded)).step == 1
        assert not Storage(root, bounded).exists("checkpoint_0000002/COMPLETE")
        assert ckpt.load(blank_state(), root, storage_options=bounded).step == 1

        outage["kind"] = "kill"  # connection refused from the shard on
        started = time.monotonic()
        with pytest.raises(ckpt.CheckpointError, match="checkpoint_0000003"):
            ckpt.save(make_state(3), root, 3, storage_options=bounded)
        assert time.monotonic() - started < 60
        own = start_s3_server(port=own.port)  # the same address, an empty server
        own.create_bucket("outage")
        state = make_state(4)
        ckpt.save(state, root, 4, storage_options=bounded)
        assert ckpt.find_latest_committed(Storage(root, bounded)).step == 4
        loaded = blank_state()
        ckpt.load(loaded, root, storage_options=bounded)
        assert_state_equal(loaded, state)
    finally:
        own.stop()


@pytest.mark.parametrize("fault", ["manifest:kill:rank=0", "complete:kill:rank=0"])
def test_a_rank_killed_before_complete_leaves_the_previous_newest(s3_server, s3_root, fault):
    ckpt.save(make_state(1), s3_root, 1)
    env = {**s3_env(s3_server.endpoint), faults.ENV_STORAGE_FAULTS: fault}
    outcomes = run_ranks(save_step_2_worker, 1, s3_root, timeout_s=60, env=env)
    assert outcomes[0].exitcode == -9, outcomes[0].error
    storage = Storage(s3_root)
    assert storage.exists("checkpoint_0000002/rank_00000.distcp")  # past the shards
    assert not storage.exists("checkpoint_0000002/COMPLETE")
    infos = {i.step: i for i in ckpt.list_checkpoints(s3_root)}
    assert infos[1].committed and not infos[2].committed
    assert assert_loads(s3_root, make_state(1)).step == 1


# -- 5. resharding, corruption, a missing bucket, ranged reads ---------------------------


def test_a_flipped_byte_shows_in_s3s_crc32c_and_load_falls_back(s3_server, s3_root):
    for step in (1, 2):
        ckpt.save(make_state(step), s3_root, step)
    bucket, prefix = split_root(s3_root)
    key = f"{prefix}/checkpoint_0000002/rank_00000.distcp"
    client = s3_server.client()
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(  # same size, and the CRC32C of what is now there
        Bucket=bucket,
        Key=key,
        Body=bytes(data),
        ChecksumAlgorithm="CRC32C",
        ChecksumCRC32C=crc32c_of(bytes(data)),
    )
    info = ckpt.find_latest_committed(s3_root)
    report = ckpt.verify_dir(Storage(s3_root).child(info.dirname), info.manifest, mode="checksum")
    assert [p for p, _ in report.problems] == ["rank_00000.distcp"]
    assert "crc32c" in report.problems[0][1] and report.bytes_checked == 0

    loaded = blank_state()
    result = ckpt.load(loaded, s3_root)
    assert result.step == 1 and [(s.step, s.path) for s in result.skipped] == [
        (2, "rank_00000.distcp")
    ]
    assert_state_equal(loaded, make_state(1))


@pytest.mark.timeout(300)
def test_fsdp2_saved_on_2_ranks_loads_on_1(s3_server, s3_root):
    assert_fsdp2_reshards(s3_root, s3_env(s3_server.endpoint), 1)


def test_a_missing_bucket_fails_save_and_load_fast_and_clearly(s3_server):
    started = time.monotonic()
    with pytest.raises(ckpt.CheckpointError, match=MISSING_BUCKET_ROOT) as err:
        ckpt.save(make_state(1), MISSING_BUCKET_ROOT, 1)
    assert time.monotonic() - started < 10 and "not found" in str(err.value)
    for missing_ok in (False, True):  # a typo must never look like a fresh run
        with pytest.raises(StoragePermanentError, match="bucket 'no-such-bucket-xyz'"):
            ckpt.load(blank_state(), MISSING_BUCKET_ROOT, missing_ok=missing_ok)


def test_large_ranges_are_read_as_parallel_ranged_gets_into_the_exact_bytes(s3_server, s3_root):
    bucket, prefix = split_root(s3_root)
    data = bytes(range(256)) * (5 * 4096) + b"tail"  # 5 MiB + 4
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/blob", Body=data)
    s3_server.reset()
    storage = Storage(s3_root, StorageOptions(transfer=S3TransferOptions(read_part_bytes=MIB)))
    got = storage.read_range("blob", 1000, len(data) - 1)
    assert bytes(got) == data[1000:-1]
    gets = [r for r in s3_server.requests() if r["method"] == "GET" and r["path"].endswith("/blob")]
    assert len(gets) == 5
    assert bytes(storage.read_range("blob", 7, 9)) == data[7:9]
    with pytest.raises(ObjectNotFoundError):
        storage.read_range("missing", 0, 10)


def test_a_load_reads_items_a_small_gap_apart_in_one_ranged_get(s3_server, s3_root):
    """A load of part of a shard: items less than OBJECT_STORE_GAP_BYTES apart come in
    one request (gap included), farther ones in their own; every item still checked."""
    from ckpt.loading.reader import OBJECT_STORE_GAP_BYTES

    gen = torch.Generator().manual_seed(3)
    near = OBJECT_STORE_GAP_BYTES // 8  # float32 elements: half the allowed gap
    far = OBJECT_STORE_GAP_BYTES // 2  # twice the allowed gap
    saved = {
        "a": torch.randn(64, generator=gen),
        "gap_near": torch.randn(near, generator=gen),
        "b": torch.randn(64, generator=gen),
        "gap_far": torch.randn(far, generator=gen),
        "c": torch.randn(64, generator=gen),
    }
    ckpt.save(saved, s3_root, 1)
    s3_server.reset()
    loaded = {k: torch.zeros(64) for k in ("a", "b", "c")}
    ckpt.load(loaded, s3_root)
    for key, value in loaded.items():
        assert torch.equal(value, saved[key]), key
    shard = [
        r
        for r in requests_under(s3_server, s3_root, "checkpoint_0000001")
        if r["method"] == "GET" and r["path"].endswith("/rank_00000.distcp")
    ]
    assert len(shard) == 2  # {a, b} across the near gap, then c


def test_transfer_options_are_checked_against_s3s_limits_and_the_scheme():
    with pytest.raises(ValueError, match="part_bytes"):
        S3TransferOptions(part_bytes=1 * MIB)
    with pytest.raises(ValueError, match="parallel_min_bytes"):
        S3TransferOptions(parallel_min_bytes=6 << 30)
    from ckpt.storage.gcs_parts import GcsTransferOptions

    with pytest.raises(StoragePermanentError, match="S3TransferOptions"):
        Storage("s3://bucket/run", StorageOptions(transfer=GcsTransferOptions()))


def test_an_object_copied_without_a_crc32c_is_read_in_full_and_verify_says_so(
    s3_server, s3_root, capsys
):
    from ckpt import cli

    ckpt.save(make_state(1), s3_root, 1)
    assert cli.main(["verify", s3_root]) == 0
    first = capsys.readouterr().out
    assert "0 B read" in first and "read in full" not in first  # every crc32c from the store
    bucket, prefix = split_root(s3_root)
    key = f"{prefix}/checkpoint_0000001/rank_00000.distcp"
    client = s3_server.client()
    data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=data)  # a stock copy: no CRC32C
    assert cli.main(["verify", s3_root]) == 0
    out = capsys.readouterr().out
    assert "1 file(s) had no crc32c in the store" in out and "rank_00000.distcp" in out
