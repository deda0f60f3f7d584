"""Fault injection is installed from outside the storage path, and ckpt keeps no
module-level mutable state but the one process-default object (``ckpt.defaults``)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.errors import StoragePermanentError
from ckpt.storage import Storage, StorageOptions, faults
from ckpt.storage.faults import FaultRegistry, StorageFault

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[1]


def _state() -> dict:
    return {"w": torch.arange(64, dtype=torch.float32), "step": 3}


def _refuse(*_args, **_kwargs):
    raise AssertionError("a storage call consulted the fault registry with no fault armed")


def test_no_fault_configured_means_the_registry_is_never_consulted(tmp_path, monkeypatch):
    for name in ("take", "run", "sink", "body"):
        monkeypatch.setattr(FaultRegistry, name, _refuse)
    root = str(tmp_path / "ckpts")
    # A manager-style owner's registry, empty ...
    options = StorageOptions(faults=FaultRegistry())
    assert ckpt.save(_state(), root, 1, storage_options=options).endswith("checkpoint_0000001")
    loaded = {"w": torch.zeros(64), "step": 0}
    assert ckpt.load(loaded, root, storage_options=options).step == 1
    # ... and the one-off functions' default registry, empty too.
    assert ckpt.save(_state(), root, 2).endswith("checkpoint_0000002")
    assert ckpt.load(loaded, root).step == 2
    assert torch.equal(loaded["w"], _state()["w"]) and loaded["step"] == 3


def test_faults_act_only_through_the_registry_a_storage_was_given(tmp_path):
    root = str(tmp_path / "root")
    armed = FaultRegistry()
    armed.install(StorageFault(phase="any", kind="permanent", times=5))
    faulty = Storage(root, StorageOptions(faults=armed, retry_attempts=1))
    clean = Storage(root, StorageOptions(faults=FaultRegistry(), retry_attempts=1))
    with pytest.raises(StoragePermanentError, match="injected permanent"):
        faulty.write_bytes("x", b"payload", phase="shard")
    clean.write_bytes("x", b"payload", phase="shard")  # the same root, no registry armed
    assert clean.read_bytes("x", phase="read") == b"payload"
    assert faulty.child("sub").faults is armed  # children keep their parent's registry


def test_truncate_is_cut_by_the_registry_and_caught_by_the_size_check(tmp_path):
    registry = FaultRegistry()
    registry.install(StorageFault(phase="shard", kind="truncate"))
    storage = Storage(
        str(tmp_path / "t"),
        StorageOptions(faults=registry, backoff_initial_s=0.01, backoff_max_s=0.02),
    )
    storage.write_bytes("blob", bytes(range(200)), phase="shard")  # retried after the cut
    assert registry._faults[0].fired == 1
    assert storage.read_bytes("blob", phase="read") == bytes(range(200))


def test_the_process_default_is_created_on_first_use_not_at_import():
    code = (
        "import json, os, tempfile, torch, ckpt\n"
        "from ckpt import defaults\n"
        "before = defaults.created() is None\n"
        "ckpt.close()\n"  # closing with nothing in flight creates nothing
        "after_close = defaults.created() is None\n"
        "root = tempfile.mkdtemp()\n"
        "ckpt.save({'a': torch.ones(2)}, root, 1)\n"
        "print(json.dumps([before, after_close, defaults.created() is not None]))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "CKPT_SAVE_THREAD_NICE": "not-a-number"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    # A bad CKPT_SAVE_THREAD_NICE does not break the import (only an async save reads it).
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, True, True]


def test_bad_storage_fault_env_fails_when_the_registry_is_built(monkeypatch):
    monkeypatch.setenv(faults.ENV_STORAGE_FAULTS, "shard:no-such-kind")
    with pytest.raises(ValueError, match="no-such-kind"):
        FaultRegistry(read_env=True)


# -- no module-level mutable state ------------------------------------------------------

ALLOWED = {("ckpt/defaults.py", "_defaults"), ("elastic/distributed.py", "_startup_detector")}
"""The process-wide holders allowed: ckpt's one process-default object, and the peer failure
detector ``elastic.init_distributed`` starts with the default process group (itself
process-wide in torch) and hands to the ``RunGuard`` built later (docs/design.md, "Failure
detection", start-up)."""


def _module_state(path: Path) -> list[str]:
    """Module-level names that hold mutable state: empty containers, instances of the
    project's own classes, thread-locals; and any ``global`` statement."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = {
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and not any("frozen=True" in ast.unparse(d) for d in node.decorator_list)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"global {', '.join(node.names)} (line {node.lineno})")
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        empty = isinstance(value, ast.Dict | ast.List | ast.Set) and not (
            getattr(value, "keys", None) or getattr(value, "elts", None)
        )
        call = isinstance(value, ast.Call)
        callee = ast.unparse(value.func) if call else ""
        stateful = call and (
            callee in own
            or callee.split(".")[-1] in {"local", "AsyncSaver", "FaultRegistry", "Lock", "RLock"}
        )
        if callee.split(".")[-1] in {"Lock", "RLock"}:
            stateful = False  # a lock guards state; it is not state
        for name in names:
            if (empty or stateful) and (str(path.relative_to(REPO)), name) not in ALLOWED:
                found.append(f"{name} = {ast.unparse(value)} (line {node.lineno})")
    return found


def test_no_module_level_mutable_state_in_ckpt_or_elastic():
    offenders = {}
    for package in ("ckpt", "elastic"):
        for path in sorted((REPO / package).rglob("*.py")):
            state = _module_state(path)
            if state:
                offenders[str(path.relative_to(REPO))] = state
    assert offenders == {}


def test_the_state_check_can_fail(tmp_path):
    bad = REPO / "ckpt" / "_probe_state_check.py"
    try:
        bad.write_text(
            "import threading\n"
            "from dataclasses import dataclass\n"
            "class Saver: ...\n"
            "@dataclass(frozen=True)\n"
            "class Policy: ...\n"
            "KEEP = Policy()\n"
            "CACHE: dict[int, int] = {}\n"
            "DEFAULT = Saver()\n"
            "_tls = threading.local()\n"
            "def f():\n    global CACHE\n"
        )
        found = _module_state(bad)
    finally:
        bad.unlink()
    assert len(found) == 4, found
