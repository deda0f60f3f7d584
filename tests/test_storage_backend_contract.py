"""Adding a storage backend is one module and one registry line, lease included.

The backend below is such a module: an in-process object store (flat keys, no
directories, like a bucket) written against :class:`ckpt.storage.base.Backend` only, with
the optional conditional record the owner lease needs. Registered under ``toy://`` by one
line, it must carry the whole contract: saves and resumes through the manager (with its
lease), ``verify``, retention, the lease refusing a second job and a race for an expired
lease won exactly once. The same store without the conditional record gets no lease: a
job on it is refused with an error that says why, before it writes anything, unless it
runs without a lease.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import pytest
import torch

import ckpt
from ckpt import cli
from ckpt.errors import ObjectNotFoundError, RecordConflict, WriteVerificationError
from ckpt.format.checksum import ChecksummingWriter
from ckpt.format.layout import is_lease_name
from ckpt.root import lease
from ckpt.storage import Storage, registry
from ckpt.storage.base import DIR, FILE, Calls, Produce
from testing import leases

pytestmark = pytest.mark.timeout(120)


class PlainToyBackend:
    """An object store in this process: ``toy://bucket/key`` -> bytes. No conditional record."""

    objects: dict[str, bytes] = {}
    lock = threading.Lock()
    scheme = "toy"

    @classmethod
    def open(cls, url: str, options: Any) -> tuple[PlainToyBackend, str]:
        return cls(), url.split("://", 1)[1].strip("/")

    def url(self, path: str) -> str:
        return f"toy://{path}"

    def write(self, path: str, produce: Produce, calls: Calls, *, phase: str) -> tuple[int, str]:
        def once() -> tuple[int, str]:
            buffer = io.BytesIO()
            stream = ChecksummingWriter(calls.stream(buffer))
            produce(stream)
            with self.lock:
                self.objects[path] = buffer.getvalue()
            if len(self.objects[path]) != stream.size:
                raise WriteVerificationError(f"{self.url(path)}: short write")
            return stream.size, stream.crc32c

        return calls.call(f"write {self.url(path)}", phase, once)

    def sync_dir(self, path: str) -> None:
        pass

    def read(self, path: str, start: int, end: int | None) -> Any:
        try:
            data = self.objects[path]
        except KeyError:
            raise FileNotFoundError(self.url(path)) from None
        return data[start:end]

    def read_range(self, path: str, start: int, end: int, calls: Calls, *, phase: str) -> Any:
        def once() -> Any:
            data = self.read(path, start, end)
            if len(data) != end - start:
                raise WriteVerificationError(f"{self.url(path)}: short read")
            return data

        return calls.call(f"read {self.url(path)}", phase, once)

    def read_into(
        self, path: str, start: int, into: memoryview, calls: Calls, *, phase: str
    ) -> None:
        into[:] = self.read_range(path, start, start + into.nbytes, calls, phase=phase)

    def read_pipeline(self) -> tuple[int | None, int]:
        return None, 1

    def _below(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        return [key for key in list(self.objects) if key.startswith(prefix)]

    def info(self, path: str) -> dict[str, Any]:
        if path in self.objects:
            return {"name": path, "size": len(self.objects[path]), "type": FILE}
        if self._below(path):
            return {"name": path, "size": 0, "type": DIR}
        raise FileNotFoundError(self.url(path))

    def list_dir(self, path: str) -> list[tuple[str, str]]:
        prefix = path.rstrip("/") + "/"
        found: dict[str, str] = {}
        for key in self._below(path):
            head, sep, _ = key[len(prefix) :].partition("/")
            found[head] = DIR if sep else FILE
        return sorted(found.items())

    def list_files(self, path: str) -> dict[str, dict[str, Any]]:
        prefix = path.rstrip("/") + "/"
        return {key[len(prefix) :]: self.info(key) for key in self._below(path)}

    def kind(self, path: str) -> str | None:
        return None

    def check_reachable(self, path: str, calls: Calls) -> str | None:
        return None

    def remove(self, path: str) -> None:
        with self.lock:
            self.objects.pop(path, None)

    def remove_tree(self, path: str) -> None:
        with self.lock:
            for key in [*self._below(path), path]:
                self.objects.pop(key, None)

    def move_tree(self, src: str, dst: str, calls: Calls) -> None:
        with self.lock:
            for key in self._below(src):
                self.objects[dst + key[len(src) :]] = self.objects.pop(key)


class ToyRecord:
    """The conditional record: a version number checked and bumped under the store's lock."""

    versions: dict[str, int] = {}

    def __init__(self, backend: ToyBackend, path: str) -> None:
        self.backend, self.path = backend, path

    def read(self) -> tuple[bytes | None, Any]:
        with self.backend.lock:
            return self.backend.objects.get(self.path), self.versions.get(self.path, 0)

    def write(self, data: bytes, version: Any) -> Any:
        with self.backend.lock:
            if self.versions.get(self.path, 0) != version:
                raise RecordConflict()
            self.backend.objects[self.path] = data
            self.versions[self.path] = version + 1
            return version + 1

    def delete(self, version: Any) -> None:
        with self.backend.lock:
            if self.versions.get(self.path, 0) == version:
                self.backend.objects.pop(self.path, None)
                self.versions[self.path] = version + 1

    def root_identity(self) -> Any:
        return None

    def prepare(self) -> None:
        pass


class ToyBackend(PlainToyBackend):
    def conditional_record(self, path: str) -> ToyRecord:
        return ToyRecord(self, path)


@pytest.fixture
def toy(monkeypatch, request):
    """Registers a backend class under ``toy://`` the way a new backend is added: one line."""

    def register(name: str) -> str:
        monkeypatch.setitem(registry.BACKENDS, "toy", f"{__name__}:{name}")
        return f"toy://bucket/{request.node.name}"

    yield register
    PlainToyBackend.objects.clear()
    ToyRecord.versions.clear()


def _manager(root: str, model: torch.nn.Module | None = None, **kw) -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(root, {"model": model or torch.nn.Linear(4, 3)}, **kw)


def _leases(root: str) -> list[str]:
    return [
        key
        for key in PlainToyBackend.objects
        if key.startswith(root[6:]) and is_lease_name(key.rsplit("/", 1)[1])
    ]


def test_a_registered_backend_saves_resumes_verifies_and_prunes_under_its_lease(toy, monkeypatch):
    root = toy("ToyBackend")
    monkeypatch.setenv("CKPT_JOB_ID", "job-a")
    model = torch.nn.Linear(4, 3)
    with _manager(root, model, every=1, retention=ckpt.RetentionPolicy(keep_last=2)) as first:
        assert first.resume() is None
        assert first.lease is not None
        assert len(_leases(root)) == 1
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.add_(1.0)
            first.maybe_save(step)
        saved = model.weight.detach().clone()
        monkeypatch.setenv("CKPT_JOB_ID", "job-b")  # a second job on the same root
        second = _manager(root, every=1)
        with pytest.raises(ckpt.RootLeaseError, match="in use by another job"):
            second.resume()
        second.close()
        monkeypatch.setenv("CKPT_JOB_ID", "job-a")
    assert _leases(root) == []  # released at close
    assert [info.step for info in ckpt.list_checkpoints(root)] == [3, 2]  # retention ran here
    assert cli.main(["verify", root]) == 0
    fresh = torch.nn.Linear(4, 3)
    with _manager(root, fresh) as again:
        assert again.resume() == 3
    assert torch.equal(fresh.weight, saved)


def test_a_race_for_an_expired_lease_on_a_registered_backend_is_won_once(toy):
    root = toy("ToyBackend")
    now = [1_000_000.0]
    clock = lambda: now[0]  # noqa: E731

    def who(name: str) -> lease.JobIdentity:
        return lease.JobIdentity(
            key=f"run:{name}", named_by=name, stable=True, run_id=name, restart_count=0,
            host="h", pid=1,
        )  # fmt: skip

    dead = lease.RootLease(Storage(root), who("dead"), 1.0, clock=clock)
    dead.acquire()
    dead._stop.set()  # died holding it
    now[0] += 5.0
    racers = [lease.RootLease(Storage(root), who(f"r{i}"), 60.0, clock=clock) for i in range(4)]
    outcomes = leases.race(racers)
    try:
        assert outcomes == ["refused"] * 3 + ["won"]
        winner = next(r for r in racers if r.held)
        assert lease.read_lease(Storage(root)).token == winner.token
    finally:
        for item in [*racers, dead]:
            item.close()


def test_a_backend_without_a_conditional_record_is_refused_a_lease_naming_why(toy, monkeypatch):
    root = toy("PlainToyBackend")
    manager = _manager(root, every=1)
    with pytest.raises(
        ckpt.RootLeaseError, match=r"toy://\) has no atomic conditional write"
    ) as err:
        manager.resume()
    assert "lease_ttl_s=0" in str(err.value)
    with pytest.raises(ckpt.RootLeaseError):
        manager.maybe_save(1)  # a script that never resumed is refused at its first save
    manager.close()
    assert PlainToyBackend.objects == {}  # nothing written
    assert lease.read_lease(Storage(root)) is None  # ls: no lease, no error
    with _manager(root, every=1, lease_ttl_s=0) as unleased:  # said by the user: no lease
        assert unleased.resume() is None
        unleased.maybe_save(1)
    assert [info.step for info in ckpt.list_checkpoints(root)] == [1]
    with pytest.raises(ObjectNotFoundError):
        Storage(root).read_bytes("OWNER")
