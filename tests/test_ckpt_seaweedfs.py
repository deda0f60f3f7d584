"""ckpt on s3:// against SeaweedFS, a production S3 server (bench/harness/seaweedfs.py).

moto (tests/test_ckpt_s3.py) is where server-side faults and the request log are needed;
it keeps a client's checksum unchecked and accepts any credentials. SeaweedFS checks
both, as S3 does, so here the backend meets a server that refuses what it should: a
body whose CRC32C does not match, a wrong secret, a conditional write that lost. The
same contract as on moto: the manifest's crc32c is the CRC32C the server keeps, a large
shard goes up as a full-object CRC32C multipart upload, a transfer fault is retried and
the save commits, a flipped byte makes a load fall back, FSDP2 reshards 2 -> 1, the root
lease is a compare-and-swap. Findings: docs/s3-server-notes.md.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Iterator

import pytest
import test_ckpt_gcs as on_gcs
import test_ckpt_s3 as on_moto
import torch
from test_ckpt_lease import job
from test_ckpt_s3 import PARTS, blank_large, large_state, options, split_root

import ckpt
from ckpt.errors import RecordConflict, StoragePermanentError
from ckpt.root import lease
from ckpt.storage import Storage, StorageOptions
from ckpt.storage.s3 import S3Record, S3TransferOptions
from testing import leases
from testing.s3_server import s3_env
from testing.seaweedfs import SeaweedServer, seaweedfs_in_environ, start_seaweedfs

pytestmark = [pytest.mark.s3, pytest.mark.timeout(180)]

MIB = 1 << 20


@pytest.fixture(scope="module")
def seaweedfs() -> Iterator[SeaweedServer]:
    """One SeaweedFS process for this module, wired into ``os.environ`` (the moto
    session's values, if any, come back afterwards). fsspec keeps one S3FileSystem per
    set of arguments, bound to the endpoint of its first request: the cache is emptied
    on the way in and out, so no filesystem of one server serves the other."""
    import s3fs

    with seaweedfs_in_environ(start_seaweedfs()) as server:
        s3fs.S3FileSystem.clear_instance_cache()
        yield server
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def seaweed_root(seaweedfs: SeaweedServer) -> Iterator[str]:
    """A fresh bucket on SeaweedFS; yields ``s3://<bucket>/ckpt``, deleted afterwards (a
    bucket's volumes stay until then: docs/s3-server-notes.md)."""
    bucket = f"test-{uuid.uuid4().hex[:16]}"
    seaweedfs.create_bucket(bucket)
    yield f"s3://{bucket}/ckpt"
    if seaweedfs.is_running():
        seaweedfs.delete_bucket(bucket)


# -- the server is the strict one the backend is written for -----------------------------


def test_seaweedfs_refuses_a_body_whose_crc32c_does_not_match_and_a_wrong_secret(
    seaweedfs, seaweed_root
):
    """What moto does not do (docs/s3-server-notes.md) and the backend relies on S3 for."""
    import botocore.exceptions
    import botocore.session

    bucket, prefix = split_root(seaweed_root)
    client = seaweedfs.client()
    wrong = base64.b64encode(b"\0\0\0\0").decode()
    with pytest.raises(botocore.exceptions.ClientError, match="BadDigest"):
        client.put_object(Bucket=bucket, Key=f"{prefix}/x", Body=b"hello", ChecksumCRC32C=wrong)
    intruder = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=seaweedfs.endpoint,
        region_name="us-east-1",
        aws_access_key_id=s3_env("")["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key="not-the-secret",
    )
    with pytest.raises(botocore.exceptions.ClientError, match="SignatureDoesNotMatch"):
        intruder.put_object(Bucket=bucket, Key=f"{prefix}/x", Body=b"hello")


def test_a_save_with_a_wrong_secret_fails_at_once_naming_the_root(seaweedfs, seaweed_root):
    started = time.monotonic()
    wrong = StorageOptions(
        backoff_initial_s=2.0,
        backoff_max_s=5.0,
        fs_kwargs={"key": s3_env("")["AWS_ACCESS_KEY_ID"], "secret": "not-the-secret"},
    )
    with pytest.raises(ckpt.CheckpointError, match=seaweed_root) as err:
        ckpt.save({"w": torch.ones(4)}, seaweed_root, 1, storage_options=wrong)
    assert "signature" in str(err.value) and "credentials" in str(err.value)
    assert time.monotonic() - started < 10  # refused, not retried with backoff
    assert ckpt.list_checkpoints(seaweed_root) == []


# -- the contract, on a server that checks ----------------------------------------------


def test_the_manifests_crc32c_is_the_one_seaweedfs_keeps_and_verify_reads_no_bytes(
    seaweedfs, seaweed_root, monkeypatch
):
    on_moto.test_manifest_crc_is_the_crc32c_s3_keeps_and_verify_reads_no_bytes(
        seaweedfs, seaweed_root, monkeypatch
    )


def test_a_large_shard_goes_up_as_parts_whose_full_object_crc32c_seaweedfs_combined(
    seaweedfs, seaweed_root
):
    state = large_state(3)
    ckpt.save(state, seaweed_root, 3, storage_options=options(transfer=PARTS))
    info = ckpt.find_latest_committed(seaweed_root)
    entry = info.manifest.file("rank_00000.distcp")
    assert entry.size > 2 * PARTS.part_bytes  # three parts
    bucket, prefix = split_root(seaweed_root)
    client = seaweedfs.client()
    head = client.head_object(
        Bucket=bucket, Key=f"{prefix}/{info.dirname}/rank_00000.distcp", ChecksumMode="ENABLED"
    )
    assert head["ChecksumType"] == "FULL_OBJECT"
    assert (head["ChecksumCRC32C"], head["ContentLength"]) == (entry.crc32c, entry.size)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    loaded = blank_large()
    ckpt.load(loaded, seaweed_root, storage_options=options(transfer=PARTS))
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3


@pytest.mark.parametrize(
    ("phase", "kind"), [("shard", "truncate"), ("shard", "reset"), ("manifest", "http503")]
)
def test_a_transfer_fault_is_retried_and_the_save_commits(seaweed_root, phase, kind):
    # truncate: the first half of each body goes out under the whole one's CRC32C;
    # SeaweedFS refuses it and the retry sends it whole
    on_gcs.test_transient_fault_is_retried_and_commits(seaweed_root, phase, kind)


def test_a_flipped_byte_shows_in_seaweedfss_crc32c_and_load_falls_back(seaweedfs, seaweed_root):
    on_moto.test_a_flipped_byte_shows_in_s3s_crc32c_and_load_falls_back(seaweedfs, seaweed_root)


def test_ranged_reads_in_parallel_bring_the_exact_bytes(seaweedfs, seaweed_root):
    bucket, prefix = split_root(seaweed_root)
    data = bytes(range(256)) * (5 * 4096) + b"tail"  # 5 MiB + 4
    seaweedfs.client().put_object(Bucket=bucket, Key=f"{prefix}/blob", Body=data)
    storage = Storage(seaweed_root, StorageOptions(transfer=S3TransferOptions(read_part_bytes=MIB)))
    assert bytes(storage.read_range("blob", 1000, len(data) - 1)) == data[1000:-1]
    assert bytes(storage.read_range("blob", 7, 9)) == data[7:9]


@pytest.mark.timeout(300)
def test_fsdp2_saved_on_2_ranks_loads_on_1(seaweedfs, seaweed_root):
    on_gcs.assert_fsdp2_reshards(seaweed_root, s3_env(seaweedfs.endpoint), 1)


# -- the root lease: SeaweedFS's conditional writes --------------------------------------


def test_the_lease_is_a_compare_and_swap_seaweedfs_decides(seaweed_root):
    first = lease.RootLease(Storage(seaweed_root), job("run:A", run_id="A"), 60.0)
    made = [first]
    try:
        first.acquire()
        second = lease.RootLease(Storage(seaweed_root), job("run:B", run_id="B"), 60.0)
        made.append(second)
        with pytest.raises(ckpt.RootLeaseError, match="run 'A'"):
            second.acquire()
        record = Storage(seaweed_root).conditional_record("OWNER")
        assert isinstance(record, S3Record)
        raw, version = record.read()
        assert lease.LeaseRecord.from_bytes(raw).run_id == "A" and version
        first.renew()  # the object moved on: a write against the old ETag loses
        with pytest.raises(RecordConflict):
            record.write(b"{}", version)
        assert lease.LeaseRecord.from_bytes(record.read()[0]).token == first.token
        first.check()
    finally:
        for held in made:
            held.close()


def test_four_jobs_racing_for_an_expired_lease_never_both_win(seaweed_root):
    class Clock:
        now = 1_000_000.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    dead = lease.RootLease(Storage(seaweed_root), job("run:dead"), 1.0, clock=clock)
    racers = [
        lease.RootLease(Storage(seaweed_root), job(f"run:{i}"), 60.0, clock=clock) for i in range(4)
    ]
    try:
        dead.acquire()
        dead._stop.set()  # died holding it
        clock.now += 5.0
        assert sorted(leases.race(racers)) == ["refused"] * 3 + ["won"]
    finally:
        for held in (dead, *racers):
            held.close()


def test_a_bucket_that_is_not_there_is_named(seaweedfs):
    with pytest.raises(StoragePermanentError, match="bucket 'no-such-bucket-xyz'"):
        ckpt.load({"w": torch.zeros(4)}, "s3://no-such-bucket-xyz/run")


def test_a_ranged_read_lands_in_the_buffer_without_a_copy_and_keeps_its_connection(
    seaweedfs, seaweed_root, monkeypatch
):
    import urllib3.connectionpool
    import urllib3.response

    bucket, prefix = split_root(seaweed_root)
    data = bytes(range(256)) * 4096 + b"end"  # 1 MiB + 3
    seaweedfs.client().put_object(Bucket=bucket, Key=f"{prefix}/blob", Body=data)
    storage = Storage(seaweed_root)
    assert bytes(storage.read_range("blob", 0, 10)) == data[:10]  # the connection made

    def copying_read(*args, **kwargs):
        raise AssertionError("urllib3's read (a copy of every byte) was used")

    opened = []
    new_conn = urllib3.connectionpool.HTTPConnectionPool._new_conn
    monkeypatch.setattr(urllib3.response.HTTPResponse, "read", copying_read)
    monkeypatch.setattr(
        urllib3.connectionpool.HTTPConnectionPool,
        "_new_conn",
        lambda self: opened.append(1) or new_conn(self),
    )
    for start in (0, 5, len(data) - 100):
        assert bytes(storage.read_range("blob", start, len(data))) == data[start:]
    assert opened == []  # each response read to its end gave its connection back
