"""Cost curve 4: many committed checkpoints under one root (:mod:`bench.curves`).

A root of ``n`` committed checkpoints of a tiny state, on local disk, on the GCS
emulator and on SeaweedFS's S3: steps 10, 20, ..., 10 (n - 4) and the four after the last of them
(:func:`root_steps`), so that retention keeping the newest 3 and every multiple of 10
(:data:`PRUNE_POLICY`) deletes exactly one checkpoint whatever ``n`` is, as a run with
``keep_every`` does after each commit. Per root, timed, every storage call counted by
kind (``list``, ``read``, ``stat``, ``write``, ``delete``: :class:`StorageCalls`) and, on
``gs://``, every HTTP request gcsfs makes (listing pages included):

- ``resume``: ``CheckpointManager.resume()`` of a new manager (the root check, the
  discovery of the newest committed checkpoint, its load);
- ``discovery``: ``ckpt.find_latest_committed(root)`` alone;
- ``ls``: ``python -m ckpt ls ROOT`` (in process, output discarded);
- ``prune``: ``ckpt.root.retention.apply_retention(root, PRUNE_POLICY)`` (deletes one
  checkpoint, put back untimed after each sample);
- ``gc``: ``python -m ckpt gc ROOT --keep-last 3 --keep-every 10 --dry-run``.

The checkpoints are not saved one by one (a thousand saves to the emulator would take
minutes): one is saved by a ``CheckpointManager`` and cloned under each step, with its
manifest and COMPLETE marker rewritten for that step through :mod:`ckpt.format.manifest` (the
files and the manager's record are those of a real save); every root is checked to hold
``n`` committed checkpoints before it is measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

OPS = ("resume", "discovery", "ls", "prune", "gc")
KEEP_EVERY = 10


def root_steps(n: int) -> list[int]:
    """The committed steps of a root of ``n`` checkpoints, oldest first (``n`` >= 5)."""
    if n < 5:
        raise ValueError(
            f"a root needs at least 5 checkpoints for the prune to delete one, got {n}"
        )
    multiples = [KEEP_EVERY * i for i in range(1, n - 3)]
    return multiples + [multiples[-1] + j for j in range(1, 5)]


def pruned_step(n: int) -> int:
    """The one step :data:`PRUNE_POLICY` deletes from a root of ``n`` (:func:`root_steps`)."""
    return root_steps(n)[-4]


def prune_policy() -> Any:
    from ckpt.root.retention import RetentionPolicy

    return RetentionPolicy(keep_last=3, keep_every=KEEP_EVERY)


class StorageCalls:
    """Counts of the storage calls made inside the block, by the verb that starts their
    description (``ckpt.storage.Storage``'s one entry point for every call); on ``gs://``
    also gcsfs' HTTP requests (``http``) and those of them that list objects
    (``list_pages``)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._undo: list[Callable[[], None]] = []

    def _add(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def __enter__(self) -> StorageCalls:
        from ckpt.storage import Storage

        original = Storage._call

        def call(storage: Any, what: str, phase: str, fn: Callable[[], Any]) -> Any:
            self._add(what.split(" ", 1)[0])
            return original(storage, what, phase, fn)

        Storage._call = call  # type: ignore[method-assign]
        self._undo.append(lambda: setattr(Storage, "_call", original))
        try:
            import gcsfs
        except ImportError:
            return self
        http = gcsfs.GCSFileSystem._call

        async def request(fs: Any, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
            self._add("http")
            if method == "GET" and str(path).endswith("/o"):
                self._add("list_pages")
            return await http(fs, method, path, *args, **kwargs)

        gcsfs.GCSFileSystem._call = request
        self._undo.append(lambda: setattr(gcsfs.GCSFileSystem, "_call", http))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()


# -- building roots ------------------------------------------------------------------------


def tiny_state() -> dict[str, Any]:
    import torch

    return {"weights": torch.arange(16, dtype=torch.float32), "note": "tiny"}


def save_template(root: str) -> str:
    """One checkpoint (step 1) of :func:`tiny_state` saved by a ``CheckpointManager`` under
    ``root`` (local); its directory."""
    import ckpt
    from ckpt.format.layout import checkpoint_dirname

    manager = ckpt.CheckpointManager(root, tiny_state(), retention=None)
    manager.save(1)
    manager.close()
    return os.path.join(root, checkpoint_dirname(1))


def clone_checkpoint(template: str, out_root: str, step: int) -> None:
    """A committed copy of the checkpoint directory ``template`` as ``step`` under the local
    ``out_root``: its files, with manifest.json and COMPLETE rewritten for ``step``."""
    from ckpt.format.checksum import crc32c_of
    from ckpt.format.layout import COMPLETE_NAME, MANIFEST_NAME, checkpoint_dirname
    from ckpt.format.manifest import CompleteMarker, Manifest

    out = os.path.join(out_root, checkpoint_dirname(step))
    os.makedirs(out)
    for name in os.listdir(template):
        if name not in (MANIFEST_NAME, COMPLETE_NAME):
            shutil.copyfile(os.path.join(template, name), os.path.join(out, name))
    with open(os.path.join(template, MANIFEST_NAME), "rb") as f:
        manifest = dataclasses.replace(Manifest.from_bytes(f.read()), step=step)
    with open(os.path.join(template, COMPLETE_NAME), "rb") as f:
        marker = CompleteMarker.from_bytes(f.read())
    raw = manifest.to_bytes()
    marker = dataclasses.replace(marker, step=step, manifest_crc32c=crc32c_of(raw))
    with open(os.path.join(out, MANIFEST_NAME), "wb") as f:
        f.write(raw)
    with open(os.path.join(out, COMPLETE_NAME), "wb") as f:
        f.write(marker.to_bytes())


def _remote_fs(root: str) -> Any:
    """The fsspec filesystem of a ``gs://`` (the emulator, anonymous) or ``s3://`` root
    (credentials and endpoint from the environment the bench set)."""
    if root.startswith("s3://"):
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True)
    import gcsfs

    return gcsfs.GCSFileSystem(token="anon")


def _remote_path(root: str) -> str:
    return root.split("://", 1)[1]


def place(template: str, root: str, steps: list[int], staging: str) -> None:
    """Clones of ``template`` at ``steps`` under ``root``: built in place when it is local,
    else under ``staging`` (local, emptied after) and uploaded."""
    local = "://" not in root
    where = root if local else staging
    os.makedirs(where, exist_ok=True)
    for step in steps:
        clone_checkpoint(template, where, step)
    if local:
        return
    from bench.disk import files_under

    files = files_under(staging)
    remote = _remote_path(root)
    _remote_fs(root).put(files, [f"{remote}/{os.path.relpath(f, staging)}" for f in files])
    shutil.rmtree(staging, ignore_errors=True)


def _quiet() -> contextlib.AbstractContextManager[Any]:
    return contextlib.redirect_stdout(io.StringIO())


def _ops(root: str, n: int) -> dict[str, Callable[[], Any]]:
    """The timed operations on ``root`` (a root of ``n``, :func:`root_steps`), each raising
    when its result is not what the root holds."""
    import ckpt
    from ckpt.cli import main as ckpt_cli
    from ckpt.root.retention import apply_retention

    def resume() -> Any:
        manager = ckpt.CheckpointManager(root, tiny_state(), retention=None)
        try:
            step = manager.resume(must=True)
        finally:
            manager.close()
        if step != root_steps(n)[-1]:
            raise RuntimeError(f"resume of {root} loaded step {step}, not {root_steps(n)[-1]}")

    def discovery() -> Any:
        info = ckpt.find_latest_committed(root)
        if info is None or info.step != root_steps(n)[-1]:
            raise RuntimeError(f"discovery under {root} found {info}")

    def ls() -> Any:
        with _quiet():
            if ckpt_cli(["ls", root]) != 0:
                raise RuntimeError(f"ckpt ls {root} failed")

    def prune() -> Any:
        plan = apply_retention(root, prune_policy())
        if list(plan.delete) != [pruned_step(n)]:
            raise RuntimeError(f"prune of {root} deleted {plan.delete}, not [{pruned_step(n)}]")

    def gc() -> Any:
        with _quiet():
            args = ["gc", root, "--keep-last", "3", "--keep-every", str(KEEP_EVERY), "--dry-run"]
            if ckpt_cli(args) != 0:
                raise RuntimeError(f"ckpt gc {root} failed")

    return {"resume": resume, "discovery": discovery, "ls": ls, "prune": prune, "gc": gc}


def _checked(root: str, n: int) -> None:
    from ckpt.root.catalog import list_checkpoints

    committed = [i.step for i in list_checkpoints(root) if i.committed]
    if committed[::-1] != root_steps(n):
        raise RuntimeError(f"{root} holds {len(committed)} committed checkpoints, expected {n}")


@contextlib.contextmanager
def _timer(out: list[float]) -> Iterator[None]:
    started = time.perf_counter()
    yield
    out.append(time.perf_counter() - started)


def roots_rounds(
    rank: int, world: int, work: str, bases: dict[str, str], counts: list[int], rounds: int
) -> dict[str, Any]:
    """Build a root of each of ``counts`` under each of ``bases`` (``{"local": dir,
    "gcs": "gs://bucket/prefix"}``), then ``rounds`` rounds of every op on every root, the
    roots' order rotating per round; one untimed warm-up of each op per base first.
    Returns ``{base: {n: {op: {"s": [...], "calls": {...}}}}}`` and the build times."""
    template_dir = save_template(os.path.join(work, "template"))
    built: dict[str, dict[int, str]] = {}
    build_s: dict[str, dict[int, float]] = {}
    for base, url in bases.items():
        for n in counts:
            root = f"{url.rstrip('/')}/n{n}"
            started = time.perf_counter()
            place(template_dir, root, root_steps(n), os.path.join(work, "staging"))
            _checked(root, n)
            build_s.setdefault(base, {})[n] = time.perf_counter() - started
            built.setdefault(base, {})[n] = root
    out: dict[str, Any] = {b: {n: {op: {"s": [], "calls": {}} for op in OPS} for n in counts}
                           for b in bases}  # fmt: skip
    keys = [(b, n) for b in bases for n in counts]
    for base in bases:  # warm-up: imports, first connections, code paths
        n = counts[0]
        for op, fn in _ops(built[base][n], n).items():
            fn()
            if op == "prune":
                _put_back(template_dir, built[base][n], n, work)
    for i in range(rounds):
        k = i % len(keys)
        for base, n in keys[k:] + keys[:k]:
            root = built[base][n]
            for op, fn in _ops(root, n).items():
                slot = out[base][n][op]
                with StorageCalls() as calls, _timer(slot["s"]):
                    fn()
                slot["calls"] = calls.counts
                if op == "prune":
                    _put_back(template_dir, root, n, work)
    for by_n in built.values():
        for root in by_n.values():
            _remove_root(root)
    return {"ops": out, "build_s": build_s}


def _put_back(template: str, root: str, n: int, work: str) -> None:
    place(template, root, [pruned_step(n)], os.path.join(work, "staging"))


def _remove_root(root: str) -> None:
    if "://" not in root:
        shutil.rmtree(root, ignore_errors=True)
        return
    with contextlib.suppress(FileNotFoundError):
        _remote_fs(root).rm(_remote_path(root), recursive=True)
