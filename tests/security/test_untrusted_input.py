"""Input from outside the process is checked: the memory tier's directory, store values,
the rendezvous store's address, environment variables and config values, and a
partially damaged checkpoint given to export."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import subprocess
import sys
import time

import pytest
import torch
from test_elastic_heartbeat import FakeStore, _fake_rank, _wait

import ckpt
import ckpt.cli
from ckpt import env as ckpt_env
from ckpt.tiers.memory.layout import MemoryDirError, open_private, secure_base_dir
from elastic.rendezvous import _wall_of, bind_address, listen_socket, parse_members

# -- the memory tier's directory -------------------------------------------------------------


def test_the_memory_directory_is_created_private(tmp_path):
    base = str(tmp_path / "mem")
    secure_base_dir(base)
    st = os.lstat(base)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    secure_base_dir(base)  # an existing one of ours is fine


@pytest.mark.parametrize("problem", ["symlink", "group-writable", "other-owner", "open-parent"])
def test_a_memory_directory_that_is_not_safely_ours_is_refused(tmp_path, problem):
    base = str(tmp_path / "mem")
    if problem == "symlink":
        os.makedirs(tmp_path / "elsewhere", mode=0o700)
        os.symlink(tmp_path / "elsewhere", base)
        expected = "symbolic link"
    elif problem == "group-writable":
        os.makedirs(base)
        os.chmod(base, 0o770)
        expected = "writable by group or others"
    elif problem == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.makedirs(base, mode=0o700)
        os.chown(base, 4242, 4242)
        expected = "belongs to uid 4242"
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        parent = tmp_path / "shared"
        os.makedirs(parent)
        os.chmod(parent, 0o777)  # writable by everyone, no sticky bit
        os.chown(parent, 4242, 4242)
        base = str(parent / "mem")
        expected = "without the sticky bit"
    with pytest.raises(MemoryDirError, match=expected) as refused:
        secure_base_dir(base)
    assert "CKPT_MEMORY_DIR" in str(refused.value) and base in str(refused.value)
    # the manager refuses it the same way, before any snapshot
    with pytest.raises(ckpt.CheckpointError, match=expected):
        ckpt.CheckpointManager(
            str(tmp_path / "root"), {"m": torch.nn.Linear(2, 2)}, memory_every=1, memory_dir=base
        )


def test_memory_tier_files_are_opened_only_as_private_regular_files(tmp_path):
    good = tmp_path / "COMMIT"
    good.write_bytes(b"{}")
    os.chmod(good, 0o600)
    os.close(open_private(str(good)))
    link = tmp_path / "link"
    os.symlink(good, link)
    with pytest.raises(OSError):
        open_private(str(link))
    loose = tmp_path / "loose"
    loose.write_bytes(b"{}")
    os.chmod(loose, 0o666)
    with pytest.raises(PermissionError):
        open_private(str(loose))


# -- store values --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_malformed_heartbeat_value_is_ignored_and_repaired_never_a_crash(caplog):
    store = FakeStore()
    verdicts: dict[int, list] = {0: [], 1: []}
    ranks = [_fake_rank(store, r, 2, verdicts[r]).start() for r in range(2)]
    try:
        assert _wait(
            lambda: all(int(store.data.get(f"t/beat/{r}", b"0")) > 3 for r in range(2)), 10
        )
        with caplog.at_level(logging.WARNING, logger="elastic.heartbeat"):
            store.set("t/beat/1", "not a number")
            time.sleep(2.0)  # three times the 0.6 s bound
        assert not verdicts[0] and not verdicts[1]
        assert int(store.data["t/beat/1"]) > 0  # rank 1 rewrote its own counter
        assert any("t/beat/1" in r.getMessage() for r in caplog.records)
    finally:
        for hb in ranks:
            hb.stop()


def test_rendezvous_values_that_are_not_what_they_should_be_are_ignored(caplog):
    from elastic.rendezvous import FtRendezvousHandler

    assert parse_members(b'["a", "b"]') == ["a", "b"]
    for bad in (b"{", b"[1, 2]", b'{"a": 1}', b"\xff\xfe", b"[" * 100_000):
        assert parse_members(bad) is None
    store = FakeStore()
    handler = FtRendezvousHandler(store, "j", 1, 2)
    store.set("ft/j/r1/members", "not json")
    with caplog.at_level(logging.WARNING, logger="elastic.rendezvous"):
        assert handler._members_of(1) is None  # ignored, not a crash
        assert handler._members_of(1) is None
    said = [r.getMessage() for r in caplog.records if "ft/j/r1/members" in r.getMessage()]
    assert len(said) == 1
    now = time.time()
    assert _wall_of("3 inf", now) == now and _wall_of("3 nan", now) == now
    assert _wall_of("3 12.5", now) == 12.5


def test_the_rendezvous_store_listens_on_the_endpoint_address_only():
    sock = listen_socket("127.0.0.1", 0)
    assert sock is not None
    try:
        host, port = sock.getsockname()[:2]
        assert host == "127.0.0.1"
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        # another address of this host (all of 127/8 is local) is not listened on
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", port), timeout=5).close()
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("host", "addresses", "bound"),
    [
        ("127.0.0.1", ["127.0.0.1"], "127.0.0.1"),
        ("10.1.2.3", ["10.1.2.3"], "10.1.2.3"),
        ("localhost", ["127.0.0.1"], "127.0.0.1"),
        ("node7", ["10.0.0.7"], "10.0.0.7"),
        # Debian maps the machine's own name to 127.0.1.1: other hosts could not reach it
        ("node7", ["127.0.1.1"], None),
        ("node7", ["10.0.0.7", "192.168.1.7"], None),
        ("::1", ["::1"], "::1"),
    ],
)
def test_which_address_the_rendezvous_store_listens_on(host, addresses, bound):
    assert bind_address(host, addresses) == bound


def test_a_hosted_ft_store_serves_on_the_endpoint_address():
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from elastic.rendezvous import FtConfig, connect_store

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    params = RendezvousParameters(
        backend="ft", endpoint=f"127.0.0.1:{port}", run_id="t", min_nodes=1, max_nodes=1,
        is_host="1",
    )  # fmt: skip
    store, listener = connect_store(params, FtConfig())
    assert listener is not None and listener.getsockname()[0] == "127.0.0.1"
    store.set("k", "v")
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.3", port), timeout=5).close()
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass


# -- environment and config values -----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("CKPT_COLLECTIVE_TIMEOUT_S", "inf"),
        ("CKPT_COLLECTIVE_TIMEOUT_S", "nan"),
        ("CKPT_STORAGE_TIMEOUT_S", "1e308"),
        ("CKPT_STORAGE_TIMEOUT_S", "-1"),
        ("CKPT_STORAGE_RETRY_TOTAL_S", "-5"),
        ("CKPT_STORAGE_RETRIES", "99999999999999999999"),
        ("CKPT_SAVE_BLOCK_BYTES", "0"),
        ("CKPT_SAVE_THREAD_NICE", "40"),
        ("CKPT_STORAGE_FAULTS", "complete:nonsense"),
    ],
)
def test_every_ckpt_variable_is_checked_when_a_manager_is_built(tmp_path, monkeypatch, name, value):
    from ckpt.storage.faults import check_env

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name if name != "CKPT_STORAGE_FAULTS" else "nonsense"):
        ckpt_env.validate()
        check_env()
    with pytest.raises(ValueError):
        ckpt.CheckpointManager(str(tmp_path / "root"), {"m": torch.nn.Linear(2, 2)})
    assert not (tmp_path / "root").exists()


def test_a_misspelt_ckpt_variable_is_said(monkeypatch, caplog):
    monkeypatch.setenv("CKPT_STORAGE_TIMEOUT", "30")  # the _S forgotten
    monkeypatch.setenv("CKPT_DIR", "/data/ckpt")  # a user's own variable (the Slurm recipe's)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        ckpt_env.validate()
    said = [r.getMessage() for r in caplog.records]
    assert any("CKPT_STORAGE_TIMEOUT " in m and "CKPT_STORAGE_TIMEOUT_S" in m for m in said)
    assert not any("CKPT_DIR" in m for m in said)


@pytest.mark.parametrize(
    ("setting", "env"),
    [
        (["--set", "optim.lr=inf"], {}),
        (["--set", "optim.weight_decay=nan"], {}),
        (["--set", "run.peer_timeout_s=1e999"], {}),
        ([], {"CKPT_COLLECTIVE_TIMEOUT_S": "inf"}),
    ],
)
def test_the_trainer_refuses_non_finite_settings_with_exit_2_and_no_traceback(
    tmp_path, setting, env
):
    proc = subprocess.run(
        [
            sys.executable, "-m", "trainer", "--config", "examples/tiny_gpt.toml",
            "--ckpt-dir", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run"), *setting,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "finite" in proc.stderr or "CKPT_COLLECTIVE_TIMEOUT_S" in proc.stderr
    assert not (tmp_path / "ckpt").exists()


# -- export of a checkpoint damaged where the model does not live -----------------------------


def test_export_writes_the_verified_model_when_files_it_does_not_read_fail(tmp_path, caplog):
    pytest.importorskip("safetensors")
    from corpus import rewrite_manifest
    from safetensors.torch import load_file

    root = str(tmp_path / "root")
    model = torch.nn.Linear(4, 3)
    ckpt.save({"model": model.state_dict(), "optim": {"lr": 0.1}}, root, 1)
    ckpt_dir = os.path.join(root, "checkpoint_0000001")
    with open(os.path.join(ckpt_dir, "manifest.json")) as f:
        data = json.load(f)
    # another rank's shard (say, its optimizer state) lost
    data["files"].append({"path": "rank_00001.distcp", "size": 4096, "crc32c": "AAAAAA=="})
    rewrite_manifest(ckpt_dir, data)
    assert ckpt.cli.main(["verify", root]) == 1
    out = str(tmp_path / "out")
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        ckpt.export(root, out)
    assert any("rank_00001.distcp" in r.getMessage() for r in caplog.records)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert torch.equal(tensors["weight"], model.weight.detach())
    # damage in a file the model lives in is still a refusal
    with open(os.path.join(ckpt_dir, "rank_00000.distcp"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"rank_00000\.distcp"):
        ckpt.export(root, str(tmp_path / "out2"))
    assert not os.path.exists(tmp_path / "out2")


def test_a_default_memory_directory_taken_by_another_user_gives_way_to_one_of_ours(
    tmp_path, monkeypatch, caplog
):
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    from ckpt.tiers.memory import layout

    default = str(tmp_path / "shm" / f"ckpt-memory-{os.geteuid()}")
    os.makedirs(default, mode=0o700)
    os.chown(default, 4242, 4242)  # a squatter created it first
    monkeypatch.setattr(layout, "DEFAULT_MEMORY_DIR", default)
    monkeypatch.delenv("CKPT_MEMORY_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    root = str(tmp_path / "root")
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    with (
        caplog.at_level(logging.WARNING, logger="ckpt"),
        ckpt.CheckpointManager(root, {"m": model}, memory_every=1, every=0) as manager,
    ):
        manager.maybe_save(1)
        manager.maybe_save(2)
    assert f"using {default}-1 instead" in caplog.text and "uid 4242" in caplog.text
    assert os.listdir(f"{default}-1") and os.stat(default).st_uid == 4242  # theirs, untouched
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    with ckpt.CheckpointManager(root, {"m": model}, memory_every=1) as again:  # a restart
        assert again.resume() == 2
    assert torch.equal(model.weight, saved)
    # a directory the user named is never swapped for another
    with pytest.raises(ckpt.CheckpointError, match="belongs to uid 4242"):
        ckpt.CheckpointManager(root, {"m": model}, memory_every=1, memory_dir=default)
