"""ckpt single-process behaviour: round trip, manifest, commit protocol, verify, fallback."""

from __future__ import annotations

import base64
import io
import itertools
import json
import logging
import os
import pickle
import subprocess
import sys

import fsspec
import google_crc32c
import pytest
import torch

import ckpt
import ckpt.errors
from ckpt.format.layout import DCP_METADATA_NAME
from ckpt.storage import Storage, StorageOptions, faults
from ckpt.storage.faults import StorageFault

pytestmark = pytest.mark.timeout(60)


def make_state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(16, 8, generator=gen),
            "b": torch.randn(8, generator=gen).to(torch.bfloat16),
            "idx": torch.randint(0, 100, (5,), generator=gen),
        },
        "step": seed,
        "lr": 0.5 + seed,
        "name": f"run-{seed}",
        "rng": torch.get_rng_state(),
    }


def blank_state() -> dict:
    return {
        "model": {
            "w": torch.zeros(16, 8),
            "b": torch.zeros(8, dtype=torch.bfloat16),
            "idx": torch.zeros(5, dtype=torch.int64),
        },
        "step": -1,
        "lr": 0.0,
        "name": "",
        "rng": torch.zeros_like(torch.get_rng_state()),
    }


def assert_state_equal(a: dict, b: dict) -> None:
    for key in ("w", "b", "idx"):
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert (a["step"], a["lr"], a["name"]) == (b["step"], b["lr"], b["name"])
    assert torch.equal(a["rng"], b["rng"])


def gcs_crc(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def fs_of(root: str):
    return fsspec.core.url_to_fs(root)


def read(root: str, rel: str) -> bytes:
    fs, path = fs_of(root)
    return fs.cat_file(f"{path}/{rel}")


def write(root: str, rel: str, data: bytes) -> None:
    fs, path = fs_of(root)
    fs.pipe_file(f"{path}/{rel}", data)


def test_round_trip_tensors_and_scalars(any_root):
    state = make_state(7)
    url = ckpt.save(state, any_root, 7, metadata={"tokens_seen": 1234, "cursor": {"samples": 99}})
    assert url == f"{any_root}/checkpoint_0000007"
    loaded = blank_state()
    result = ckpt.load(loaded, any_root)
    assert result.step == 7
    assert result.url == url
    assert result.metadata == {"tokens_seen": 1234, "cursor": {"samples": 99}}
    assert result.bytes_read > 0
    assert_state_equal(loaded, state)


def test_manifest_and_complete_are_right(any_root):
    state = make_state(3)
    ckpt.save(state, any_root, 3, metadata={"note": "x"})
    fs, path = fs_of(any_root)
    ckpt_path = f"{path}/checkpoint_0000003"
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.find(ckpt_path))
    assert names == sorted([".metadata", "rank_00000.distcp", "manifest.json", "COMPLETE"])
    manifest_bytes = read(any_root, "checkpoint_0000003/manifest.json")
    manifest = json.loads(manifest_bytes)
    assert manifest["format_version"] == 1
    assert manifest["step"] == 3
    assert manifest["world_size"] == 1
    assert manifest["torch_version"] == torch.__version__
    assert manifest["run_id"] == "local" and manifest["restart_count"] == 0
    assert manifest["membership"][0]["rank"] == 0 and manifest["membership"][0]["host"]
    assert manifest["metadata"] == {"note": "x"}
    listed = {f["path"]: f for f in manifest["files"]}
    assert set(listed) == {".metadata", "rank_00000.distcp"}
    for rel, entry in listed.items():
        data = read(any_root, f"checkpoint_0000003/{rel}")
        assert entry["size"] == len(data)
        assert entry["crc32c"] == gcs_crc(data), rel  # recomputed independently
    complete = json.loads(read(any_root, "checkpoint_0000003/COMPLETE"))
    assert complete["step"] == 3
    assert complete["manifest_crc32c"] == gcs_crc(manifest_bytes)
    assert complete["attempt"]["save_id"] == manifest["attempt"]["save_id"]


def test_plain_dcp_load_reads_our_local_checkpoint(tmp_root):
    import torch.distributed.checkpoint as dcp

    state = make_state(5)
    url = ckpt.save(state, tmp_root, 5)
    loaded = blank_state()
    dcp.load(loaded, checkpoint_id=url)
    assert_state_equal(loaded, state)


def test_a_checkpoint_written_by_python_3_11_2_loads_verifies_and_reads_in_stock_dcp(
    tmp_root, monkeypatch
):
    """Python 3.11.0 to 3.11.3 (Debian 12's python3.11 is 3.11.2) pickle an enum member as
    ``getattr(EnumClass, "NAME")``; DCP's .metadata holds one per tensor (its memory
    format). A checkpoint written that way resumes, verifies deep and reads in dcp.load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    monkeypatch.setattr(
        _MEM_FORMAT_ENCODING, "__reduce_ex__", lambda self, proto: (getattr, (type(self), self.name))
    )
    state = make_state(4)
    url = ckpt.save(state, tmp_root, 4)
    monkeypatch.undo()
    assert b"getattr" in read(tmp_root, f"checkpoint_0000004/{DCP_METADATA_NAME}")
    loaded = blank_state()
    assert ckpt.load(loaded, tmp_root).step == 4
    assert_state_equal(loaded, state)
    verify = subprocess.run(
        [sys.executable, "-m", "ckpt", "verify", "--deep", tmp_root],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    stock = blank_state()
    dcp.load(stock, checkpoint_id=url)
    assert_state_equal(stock, state)


@pytest.mark.parametrize("phase", ["shard", "metadata", "manifest", "complete"])
def test_save_interrupted_before_complete_is_not_discovered(any_root, phase):
    first = make_state(1)
    ckpt.save(first, any_root, 1)
    with (
        faults.inject(StorageFault(phase=phase, kind="permanent")) as armed,
        pytest.raises(ckpt.CheckpointError),
    ):
        ckpt.save(make_state(2), any_root, 2)
    assert armed[0].fired == 1
    infos = ckpt.list_checkpoints(any_root)
    assert not any(i.committed and i.step == 2 for i in infos)
    assert ckpt.find_latest_committed(any_root).step == 1
    loaded = blank_state()
    assert ckpt.load(loaded, any_root).step == 1
    assert_state_equal(loaded, first)


def _corrupt_flip(root: str, rel: str) -> None:
    data = bytearray(read(root, rel))
    data[len(data) // 2] ^= 0x40
    write(root, rel, bytes(data))


def _corrupt_truncate(root: str, rel: str) -> None:
    write(root, rel, read(root, rel)[:-100])


def _corrupt_delete(root: str, rel: str) -> None:
    fs, path = fs_of(root)
    fs.rm_file(f"{path}/{rel}")


@pytest.mark.parametrize(
    ("corrupt", "rel", "deep_only"),
    [
        (_corrupt_flip, "rank_00000.distcp", True),
        (_corrupt_truncate, "rank_00000.distcp", False),
        (_corrupt_delete, ".metadata", False),
        (_corrupt_flip, ".metadata", True),
    ],
    ids=["flipped-byte", "truncated-shard", "missing-metadata", "flipped-metadata"],
)
def test_damaged_checkpoint_fails_verify_and_load_falls_back(any_root, corrupt, rel, deep_only):
    good = make_state(1)
    ckpt.save(good, any_root, 1)
    ckpt.save(make_state(2), any_root, 2)
    corrupt(any_root, f"checkpoint_0000002/{rel}")

    info = ckpt.find_latest_committed(any_root)
    assert info.step == 2  # still committed: damage is found by verify/load, not discovery
    storage = Storage(any_root).child(info.dirname)
    deep = ckpt.verify_dir(storage, info.manifest, deep=True)
    assert not deep.ok and deep.problems[0][0] == rel
    fast = ckpt.verify_dir(storage, info.manifest, deep=False)
    assert fast.ok is deep_only
    with pytest.raises(ckpt.CorruptCheckpointError, match=rel.replace(".", r"\.")):
        deep.raise_if_bad()

    events: list[dict] = []
    loaded = blank_state()
    result = ckpt.load(loaded, any_root, on_event=events.append)
    assert result.step == 1
    assert_state_equal(loaded, good)
    assert [s.step for s in result.skipped] == [2]
    fallback = [e for e in events if e["event"] == "ckpt_fallback"]
    assert len(fallback) == 1 and fallback[0]["step"] == 2
    assert rel in fallback[0]["reason"]
    assert fallback[0]["path"] == rel and result.skipped[0].path == rel


def test_every_checkpoint_bad_raises_instead_of_starting_over(any_root):
    ckpt.save(make_state(1), any_root, 1)
    _corrupt_truncate(any_root, "checkpoint_0000001/rank_00000.distcp")
    with pytest.raises(ckpt.NoLoadableCheckpointError, match="none could be loaded") as err:
        ckpt.load(blank_state(), any_root, missing_ok=True)
    assert err.value.reasons[0][0] == 1


def test_missing_root_and_missing_ok(any_root):
    assert ckpt.load(blank_state(), any_root, missing_ok=True) is None
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no committed checkpoint"):
        ckpt.load(blank_state(), any_root)


def test_load_given_step_does_not_fall_back(any_root):
    ckpt.save(make_state(1), any_root, 1)
    ckpt.save(make_state(2), any_root, 2)
    loaded = blank_state()
    assert ckpt.load(loaded, any_root, step=1).step == 1
    assert_state_equal(loaded, make_state(1))
    _corrupt_truncate(any_root, "checkpoint_0000002/rank_00000.distcp")
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.load(blank_state(), any_root, step=2)


def test_shape_mismatch_names_tensor_and_both_shapes(any_root):
    ckpt.save(make_state(1), any_root, 1)
    wrong = blank_state()
    wrong["model"]["w"] = torch.zeros(16, 9)
    with pytest.raises(ckpt.StateMismatchError, match=r"model\.w.*\(16, 8\).*\(16, 9\)"):
        ckpt.load(wrong, any_root)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _trained(optim_type=torch.optim.AdamW, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
    optim = optim_type(model.parameters(), lr=0.1, **kwargs)
    return model, optim


def _step(model, optim) -> None:
    model(torch.randn(3, 6, generator=torch.Generator().manual_seed(7))).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()


def _assert_optim_equal(want: torch.optim.Optimizer, got: torch.optim.Optimizer) -> None:
    assert len(got.state) == len(want.state) > 0
    for index, (p_want, p_got) in enumerate(zip(want.state.values(), got.state.values())):
        assert set(p_got) == set(p_want), index
        for name, value in p_want.items():
            assert torch.equal(value, p_got[name]), (index, name)  # bitwise, step included


@pytest.mark.parametrize(
    "optim_type, kwargs",
    [
        (torch.optim.AdamW, {}),
        (torch.optim.Adam, {"amsgrad": True}),
        (torch.optim.SGD, {"momentum": 0.9}),
    ],
)
def test_load_into_a_fresh_optimizer_object_restores_its_state(
    tmp_root, optim_type, kwargs, caplog
):
    model, optim = _trained(optim_type, **kwargs)
    _step(model, optim)
    ckpt.save({"model": model.state_dict(), "optim": optim.state_dict()}, tmp_root, 1)

    model2, optim2 = _trained(optim_type, **kwargs)  # never stepped: no state yet
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        result = ckpt.load({"model": model2, "optim": optim2}, tmp_root)
    assert result.not_loaded == [] and not _warnings(caplog)
    _assert_optim_equal(optim, optim2)
    # and it trains on exactly as the original does
    _step(model, optim)
    _step(model2, optim2)
    _assert_optim_equal(optim, optim2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_values_the_state_has_no_place_for_are_reported_and_said(tmp_root, caplog):
    model, optim = _trained()
    _step(model, optim)
    ckpt.save({"model": model.state_dict(), "optim": optim.state_dict(), "epoch": 3}, tmp_root, 1)

    model2, optim2 = _trained()
    state = {"model": model2.state_dict(), "optim": optim2.state_dict()}  # no 'state' entries
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        result = ckpt.load(state, tmp_root)
    expected = sorted(
        f"optim.state.{i}.{name}" for i in range(4) for name in ("exp_avg", "exp_avg_sq", "step")
    )
    assert result.not_loaded == expected  # "epoch" was not asked for: not listed
    said = _warnings(caplog)
    assert len(said) == 1 and "12 value(s)" in said[0] and "optim.state.0.exp_avg" in said[0]
    assert "pass the optimizer object" in said[0] and "get_state_dict" in said[0]
    assert torch.equal(state["model"]["0.weight"], model.state_dict()["0.weight"])

    caplog.clear()  # a subset of the top-level keys is a choice, not a loss: silent
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        result = ckpt.load({"model": _trained()[0].state_dict()}, tmp_root)
    assert result.not_loaded == [] and not _warnings(caplog)


def test_an_optimizer_saved_before_its_first_step_loads_into_a_fresh_one(tmp_root):
    model, optim = _trained()
    ckpt.save({"model": model, "optim": optim}, tmp_root, 0)
    model2, optim2 = _trained()
    result = ckpt.load({"model": model2, "optim": optim2}, tmp_root)
    assert result.not_loaded == [] and not optim2.state  # nothing invented for it


def test_committed_checkpoint_is_never_overwritten(any_root):
    ckpt.save(make_state(1), any_root, 1)
    with pytest.raises(ckpt.errors.CheckpointExistsError, match="already committed"):
        ckpt.save(make_state(9), any_root, 1)
    loaded = blank_state()
    ckpt.load(loaded, any_root)
    assert_state_equal(loaded, make_state(1))


def test_partial_leftovers_at_the_same_step_are_replaced(any_root):
    with (
        faults.inject(StorageFault(phase="complete", kind="permanent")),
        pytest.raises(ckpt.CheckpointError),
    ):
        ckpt.save(make_state(4), any_root, 4)
    fs, path = fs_of(any_root)
    assert not fs.exists(f"{path}/checkpoint_0000004")  # a failed save cleans up after itself
    # A killed attempt cannot: its files stay until the next save of the step.
    fs.makedirs(f"{path}/checkpoint_0000004", exist_ok=True)
    write(any_root, "checkpoint_0000004/rank_00007.distcp", b"stale shard of a dead attempt")
    ckpt.save(make_state(5), any_root, 4)
    info = ckpt.find_latest_committed(any_root)
    assert info.step == 4
    fs, path = fs_of(any_root)
    assert not fs.exists(f"{path}/checkpoint_0000004/rank_00007.distcp")


def test_older_attempt_is_fenced(any_root, monkeypatch):
    # This process started before attempt 2 committed: it is a zombie of attempt 1.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    ckpt.save(make_state(1), any_root, 10)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(ckpt.errors.FencedError, match="older attempt"):
        ckpt.save(make_state(2), any_root, 11)
    assert ckpt.find_latest_committed(any_root).step == 10


def test_relaunch_under_the_same_run_id_is_not_fenced(any_root, monkeypatch):
    # A new launch reuses the run id and counts restarts from 0 again; the earlier
    # launch's commits predate its processes, so they do not fence it.
    import time

    from ckpt.saving import commit

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    ckpt.save(make_state(1), any_root, 10)
    time.sleep(0.05)
    relaunched_at = time.time()
    monkeypatch.setattr(commit, "process_start_time", lambda: relaunched_at)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    ckpt.save(make_state(2), any_root, 11)
    assert ckpt.find_latest_committed(any_root).step == 11


@pytest.mark.parametrize("phase", ["shard", "metadata", "manifest", "complete"])
@pytest.mark.parametrize("kind", ["http429", "http503", "timeout", "reset", "truncate"])
def test_transient_storage_faults_are_retried_and_commit(memory_root, phase, kind):
    opts = StorageOptions(backoff_initial_s=0.01, backoff_max_s=0.02)
    with faults.inject(StorageFault(phase=phase, kind=kind, times=2)) as armed:
        ckpt.save(make_state(3), memory_root, 3, storage_options=opts)
    assert armed[0].fired == 2
    info = ckpt.find_latest_committed(memory_root)
    assert info.step == 3
    report = ckpt.verify_dir(Storage(memory_root).child(info.dirname), info.manifest, deep=True)
    assert report.ok, report.problems
    loaded = blank_state()
    ckpt.load(loaded, memory_root)
    assert_state_equal(loaded, make_state(3))


def test_hung_storage_call_times_out_and_is_retried(memory_root):
    opts = StorageOptions(timeout_s=0.5, backoff_initial_s=0.01, backoff_max_s=0.02)
    with faults.inject(StorageFault(phase="shard", kind="hang")) as armed:
        ckpt.save(make_state(3), memory_root, 3, storage_options=opts)
    assert armed[0].fired == 1
    assert ckpt.find_latest_committed(memory_root).step == 3


def test_permanent_fault_fails_fast_without_retrying(memory_root):
    import time

    opts = StorageOptions(backoff_initial_s=1.0, backoff_max_s=5.0)
    started = time.monotonic()
    with (
        faults.inject(StorageFault(phase="shard", kind="permanent", times=5)) as armed,
        pytest.raises(ckpt.CheckpointError, match=r"403|not retried"),
    ):
        ckpt.save(make_state(3), memory_root, 3, storage_options=opts)
    assert armed[0].fired == 1  # no second attempt
    assert time.monotonic() - started < 5
    assert ckpt.find_latest_committed(memory_root) is None


def test_untrusted_metadata_cannot_run_code(tmp_root):
    ckpt.save(make_state(1), tmp_root, 1)
    ckpt.save(make_state(2), tmp_root, 2)

    class Evil:
        def __reduce__(self):
            return (exec, ("open('/tmp/ckpt-pwned', 'w').write('x')",))

    payload = pickle.dumps(Evil())
    manifest_path = "checkpoint_0000002/manifest.json"
    manifest = json.loads(read(tmp_root, manifest_path))
    for entry in manifest["files"]:  # make the forged file pass size/crc checks
        if entry["path"] == ".metadata":
            entry["size"], entry["crc32c"] = len(payload), gcs_crc(payload)
    new_manifest = json.dumps(manifest).encode()
    write(tmp_root, "checkpoint_0000002/.metadata", payload)
    write(tmp_root, manifest_path, new_manifest)
    complete = json.loads(read(tmp_root, "checkpoint_0000002/COMPLETE"))
    complete["manifest_crc32c"] = gcs_crc(new_manifest)
    write(tmp_root, "checkpoint_0000002/COMPLETE", json.dumps(complete).encode())

    import os

    if os.path.exists("/tmp/ckpt-pwned"):
        os.unlink("/tmp/ckpt-pwned")
    result = ckpt.load(blank_state(), tmp_root)
    assert result.step == 1
    assert "not DCP metadata" in result.skipped[0].reason or "refusing" in result.skipped[0].reason
    assert not os.path.exists("/tmp/ckpt-pwned")


def test_storage_rejects_non_string_roots(tmp_path):
    with pytest.raises(TypeError, match="str URL"):
        ckpt.save(make_state(1), tmp_path, 1)  # a pathlib.Path, not a str


def test_chunk_checksums_cover_every_byte_of_each_shard(tmp_root):
    ckpt.save(make_state(2), tmp_root, 2)
    manifest = ckpt.find_latest_committed(tmp_root).manifest
    assert set(manifest.chunks) == {"rank_00000.distcp"}  # one rank: one shard file
    data = read(tmp_root, "checkpoint_0000002/rank_00000.distcp")
    chunks = manifest.chunks["rank_00000.distcp"]
    for offset, length, crc in chunks:
        assert gcs_crc(data[offset : offset + length]) == crc
    # The chunks tile the file: in order from byte 0 to its end, no gap, no overlap,
    # none empty (a length sum alone would let a gap hide behind an overlap).
    spans = [(offset, length) for offset, length, _ in chunks]
    ends = [0] + [offset + length for offset, length in spans]
    assert [offset for offset, _ in spans] == ends[:-1], spans
    assert ends[-1] == len(data), (spans, len(data))
    assert all(length > 0 for _, length in spans), spans
    # One chunk per item, on the item's bytes: the spans DCP's metadata records.
    metadata = pickle.loads(read(tmp_root, f"checkpoint_0000002/{DCP_METADATA_NAME}"))
    items = sorted(
        (info.offset, info.length)
        for info in metadata.storage_data.values()
        if info.relative_path == "rank_00000.distcp"
    )
    assert spans == items


def test_local_writes_start_writeback_early_for_consecutive_ranges(tmp_path, monkeypatch):
    from ckpt.storage import local as storage_mod

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(
        storage_mod, "_sync_file_range", lambda fd, off, n: calls.append((off, n)) or 0
    )
    data = os.urandom(3 << 20)

    def produce(stream):
        for _ in range(12):  # 36 MiB in 3 MiB writes
            stream.write(memoryview(data))

    record = Storage(str(tmp_path)).write("shard.bin", produce, phase="shard")
    assert record.size == 36 << 20
    assert (tmp_path / "shard.bin").read_bytes() == data * 12
    assert calls and calls[0][0] == 0
    for (off, n), (next_off, _) in itertools.pairwise(calls):
        assert next_off == off + n  # no gap, no overlap
    assert all(n >= storage_mod.WRITE_BEHIND_BYTES for _, n in calls)
    assert sum(n for _, n in calls) >= 32 << 20


def test_local_sink_passes_big_buffers_on_in_pieces():
    from ckpt.storage import local as storage_mod

    class Recorder:
        def __init__(self):
            self.sizes: list[int] = []
            self.data = bytearray()

        def write(self, view):
            self.sizes.append(len(view))
            self.data += view
            return len(view)

        def flush(self):
            pass

    sink = Recorder()
    local = storage_mod.LocalSink(sink, sink, write_behind=False)
    data = os.urandom(storage_mod.WRITE_PIECE_BYTES * 2 + 5)
    assert local.write(data) == len(data)
    assert sink.sizes == [storage_mod.WRITE_PIECE_BYTES] * 2 + [5]
    assert bytes(sink.data) == data


def test_large_tensors_are_saved_as_row_blocks_that_plain_dcp_reads(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    monkeypatch.setenv("CKPT_SAVE_BLOCK_BYTES", "2000")  # 10 rows of 50 fp32 per block
    torch.manual_seed(0)
    state = {
        "big": torch.randn(305, 50),
        "transposed": torch.randn(50, 305).t(),  # not contiguous: blocks are cloned
        "small": torch.randn(7),
        "scalar": torch.tensor(1.5),
        "n": 3,
    }
    root = str(tmp_path)
    ckpt.save(state, root, 1)
    info = ckpt.find_latest_committed(root)
    n_items = sum(len(c) for c in info.manifest.chunks.values())
    assert n_items == 31 + 31 + 1 + 1 + 1
    blank = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    ckpt.load(blank, root)
    plain = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    dcp.load(plain, checkpoint_id=f"{root}/{info.dirname}")
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(blank[key], value) and torch.equal(plain[key], value), key
    assert blank["n"] == 3


def test_row_block_views_share_memory_instead_of_copying():
    from ckpt.saving.writer import own_storage

    base = torch.arange(100.0).reshape(20, 5)
    block = base.narrow(0, 4, 6)
    exact = own_storage(block)
    assert exact.data_ptr() == block.data_ptr()  # same memory
    assert exact.untyped_storage().nbytes() == 6 * 5 * 4  # a storage of just these rows
    assert torch.equal(exact, block)
    buf = io.BytesIO()
    torch.save(exact, buf)
    assert torch.load(io.BytesIO(buf.getvalue())).untyped_storage().nbytes() == 120


def test_the_public_functions_survive_importing_every_room_of_the_package():
    # a subpackage named like a public function would replace it on the package once
    # imported (``import ckpt.save.x`` sets ``ckpt.save``): rooms never take those names
    code = (
        "import importlib, pkgutil, ckpt\n"
        "names = [m.name for m in pkgutil.walk_packages(ckpt.__path__, 'ckpt.')]\n"
        "names.remove('ckpt.__main__')  # the CLI: it runs on import\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "import ckpt.saving.commit as commit, ckpt.loading.restore as restore\n"
        "bad = [n for n in ckpt.__all__ if type(getattr(ckpt, n)).__name__ == 'module']\n"
        "assert not bad, bad\n"
        "assert all(callable(getattr(ckpt, n)) for n in ('save', 'load', 'export'))\n"
        "print(len(names))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 40  # every module was imported


def test_storage_options_never_print_their_credentials():
    options = StorageOptions(fs_kwargs={"key": "AKIAEXAMPLE", "secret": "s3cr3t-value"})
    assert "s3cr3t-value" not in repr(options) and "AKIAEXAMPLE" not in str(options)
    assert options.fs_kwargs["secret"] == "s3cr3t-value"  # still passed to the filesystem


def test_ckpt_exports_the_base_error_and_those_a_script_catches():
    import ckpt.errors

    exported = {n for n in ckpt.__all__ if n.endswith("Error")}
    assert exported == {
        "CheckpointError", "CheckpointDirError", "CheckpointNotFoundError",
        "CheckpointShapeError", "CorruptCheckpointError", "NoLoadableCheckpointError",
        "NonFiniteStateError", "RootLeaseError", "StateMismatchError",
        "TooManySaveFailuresError",
    }  # fmt: skip
    assert all(issubclass(getattr(ckpt, n), ckpt.CheckpointError) for n in exported)
    # The others are ckpt.errors': the old names still resolve, with a DeprecationWarning.
    with pytest.warns(DeprecationWarning, match="ckpt.FencedError is ckpt.errors.FencedError"):
        assert ckpt.FencedError is ckpt.errors.FencedError
    with pytest.raises(AttributeError, match="NoSuchError"):
        ckpt.NoSuchError  # noqa: B018
