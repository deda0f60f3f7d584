"""Object-store rounds: ``ckpt.save``/``ckpt.load`` against one raw stream, same server.

Each rank, in the same rounds (each pair in alternating order, round 0 a warm-up):

- ours: ``ckpt.save`` of the FSDP2 state to ``<scheme>://<bucket>/ours_<i>``, and the
  same save with every shard forced through parallel parts (a side figure);
- the raw stream: one request of as many bytes as the rank's shard (``put``), i.e.
  what a single upload of the same bytes costs with the store's own client;
- a cold ``ckpt.load`` of that checkpoint (a new process-level ``Storage``, nothing
  cached) against one ``get`` of the object ``put`` wrote.

:mod:`bench.gcs` and :mod:`bench.s3` say which raw client each store is compared with.
"""

from __future__ import annotations

import os
import time
from typing import Any

from bench.fsdp_state import build_trained, local_tensor_bytes, sharded_state


class RawStream:
    """One object in one request, with the store's usual client (the baseline)."""

    def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def get(self, key: str) -> int:
        """Read the whole object; its length."""
        raise NotImplementedError

    def remove(self, prefix: str) -> None:
        raise NotImplementedError


class GcsfsStream(RawStream):
    """gcsfs ``pipe`` / ``cat`` (anonymous: the emulator)."""

    def __init__(self, bucket: str) -> None:
        import gcsfs

        self.bucket = bucket
        self.fs = gcsfs.GCSFileSystem(token="anon")

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe(f"{self.bucket}/{key}", data)

    def get(self, key: str) -> int:
        return len(self.fs.cat(f"{self.bucket}/{key}"))

    def remove(self, prefix: str) -> None:
        try:
            self.fs.rm(f"{self.bucket}/{prefix}", recursive=True)
        except FileNotFoundError:
            pass


class BotocoreStream(RawStream):
    """botocore ``PutObject`` / ``GetObject`` with the client's defaults (credentials and
    endpoint from the environment)."""

    def __init__(self, bucket: str) -> None:
        import botocore.session

        self.bucket = bucket
        self.client = botocore.session.get_session().create_client("s3")

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def get(self, key: str) -> int:
        return len(self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read())

    def remove(self, prefix: str) -> None:
        listed = self.client.list_objects_v2(Bucket=self.bucket, Prefix=f"{prefix}/")
        keys = [{"Key": o["Key"]} for o in listed.get("Contents", [])]
        if keys:
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})


def _stream_and_forced(scheme: str, bucket: str, shard_len: int) -> tuple[RawStream, Any]:
    """The raw stream of ``scheme`` and storage options that send every shard as parts."""
    from ckpt.storage import StorageOptions

    if scheme == "gs":
        from ckpt.storage.gcs_parts import GcsTransferOptions

        part = max(1 << 20, shard_len // 4)
        forced: Any = GcsTransferOptions(parallel_min_bytes=0, part_bytes=part)
        return GcsfsStream(bucket), StorageOptions(transfer=forced)
    from ckpt.storage.s3 import MIN_PART_BYTES, S3TransferOptions

    forced = S3TransferOptions(parallel_min_bytes=0, part_bytes=max(MIN_PART_BYTES, shard_len // 4))
    return BotocoreStream(bucket), StorageOptions(transfer=forced)


def store_rounds(
    rank: int, world: int, scheme: str, bucket: str, width: int, rounds: int
) -> dict[str, Any]:
    """Rounds of {save, put, parts} then {load, get}; raw samples for the metrics."""
    import torch.distributed as dist

    import ckpt
    from bench.rounds import dist_all_gather

    model, optim = build_trained(width)
    state = sharded_state(model, optim)
    shard_len = local_tensor_bytes(state)
    raw, forced = _stream_and_forced(scheme, bucket, shard_len)
    samples: dict[str, list[float]] = {k: [] for k in ("ours", "put", "parts", "load", "get")}
    ours_bytes: list[int] = []
    load_bytes: list[int] = []

    def timed(name: str, fn: Any) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        samples[name].append(time.perf_counter() - t0)

    def ours(i: int) -> None:
        events: list[dict[str, Any]] = []
        timed(
            "ours",
            lambda: ckpt.save(state, f"{scheme}://{bucket}/ours_{i}", 1, on_event=events.append),
        )
        if rank == 0:
            ours_bytes.append(int(events[0]["bytes"]))

    def parts(i: int) -> None:
        url = f"{scheme}://{bucket}/parts_{i}"
        timed("parts", lambda: ckpt.save(state, url, 1, storage_options=forced))

    payload = os.urandom(1 << 20) * max(1, shard_len >> 20)
    put_bytes = sum(dist_all_gather(len(payload)))

    def put(i: int) -> None:
        timed("put", lambda: raw.put(f"put_{i}/rank{rank}", payload))

    def load(i: int) -> None:
        results: list[Any] = []
        timed("load", lambda: results.append(ckpt.load(state, f"{scheme}://{bucket}/ours_{i}")))
        load_bytes.append(sum(dist_all_gather(int(results[0].bytes_read))))

    def get(i: int) -> None:
        got: list[int] = []
        timed("get", lambda: got.append(raw.get(f"put_{i}/rank{rank}")))
        assert got == [len(payload)]

    for i in range(rounds + 1):
        for op in (ours, put, parts) if i % 2 == 0 else (parts, put, ours):
            op(i)
        for op in (load, get) if i % 2 == 0 else (get, load):
            op(i)
        dist.barrier()
        if rank == 0:
            for prefix in (f"ours_{i}", f"put_{i}", f"parts_{i}"):
                raw.remove(prefix)
        dist.barrier()
    ckpt.close()
    return {
        **{f"{name}_s": values for name, values in samples.items()},
        "ours_bytes": ours_bytes,
        "put_bytes": put_bytes,
        "load_bytes": load_bytes,
    }
