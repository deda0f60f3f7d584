"""Hostile inputs for the security tests: pickles that run a command, and forged checkpoints.

Every gadget, if decoded by a plain ``pickle.loads``, would run ``touch CANARY`` (or
write it; the extension-code and persistent-id ones need an unpickler that resolves
them): the tests assert that the canary never appears. Nothing here executes a
gadget; it only builds bytes. The dotted-name gadgets are checked to resolve to
``os.system`` by attribute walking (so they are real attacks on an allowlist that
walks attributes), never called.
"""

from __future__ import annotations

import copyreg
import importlib
import io
import json
import os
import pickle
import shlex
import struct
import subprocess
from collections.abc import Callable

import torch

from ckpt.format.checksum import crc32c_of
from ckpt.format.manifest import CompleteMarker, Manifest

DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.serialization",
    "torch",
    "pathlib",
)
"""Modules an earlier allowlist reached into: each has a dotted path to ``os.system``."""
EXT_CODE = 0x7FFF_FFF0
"""A copyreg extension code the EXT gadgets use (registered only while they are decoded)."""


class _Reduce:
    """Pickles as ``fn(*args)`` (what a malicious ``__reduce__`` writes)."""

    def __init__(self, fn: Callable, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _frame(payload: bytes, proto: int = 4) -> bytes:
    return bytes([pickle.PROTO[0], proto]) + payload + pickle.STOP


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw


def _resolves_to_system(module: str, dotted: str) -> bool:
    obj: object = importlib.import_module(module)
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj is os.system


def dotted_paths() -> dict[str, str]:
    """``{module: dotted name}`` reaching ``os.system`` from each of :data:`DCP_MODULES`."""
    out = {}
    for module in DCP_MODULES:
        for dotted in ("os.system", "distributed.checkpoint.filesystem.os.system"):
            if _resolves_to_system(module, dotted):
                out[module] = dotted
                break
    return out


def hostile_pickles(canary: str) -> dict[str, bytes]:
    """Name -> pickle bytes; each would create ``canary`` if unpickled without a guard."""
    cmd = f"touch {shlex.quote(canary)}"
    out: dict[str, bytes] = {}
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        out[f"reduce-os-system-p{proto}"] = pickle.dumps(_Reduce(os.system, cmd), protocol=proto)
    out["reduce-popen"] = pickle.dumps(_Reduce(subprocess.Popen, ["touch", canary]), protocol=4)
    out["reduce-eval"] = pickle.dumps(
        _Reduce(eval, f"__import__('os').system({cmd!r})"), protocol=2
    )
    out["reduce-exec"] = pickle.dumps(_Reduce(exec, f"open({canary!r}, 'w').close()"), protocol=3)
    for module, dotted in dotted_paths().items():
        # protocol 4 resolves "a.b.c" names by walking attributes from the module
        out[f"dotted-{module}"] = _frame(
            _unicode(module)
            + _unicode(dotted)
            + pickle.STACK_GLOBAL
            + _unicode(cmd)
            + pickle.TUPLE1
            + pickle.REDUCE
        )
    quoted = cmd.encode()
    # protocol 0: INST builds module.name(*args) in one opcode
    out["inst"] = b"(S'" + quoted + b"'\nios\nsystem\n."
    # protocol 1: OBJ calls a class (or anything) taken from the stack
    out["obj"] = b"(cos\nsystem\nS'" + quoted + b"'\no."
    # an allowed class, then BUILD with a state whose value is a gadget
    out["build-state"] = _frame(
        _unicode("torch.distributed.checkpoint.metadata")
        + _unicode("TensorProperties")
        + pickle.STACK_GLOBAL
        + pickle.EMPTY_TUPLE
        + pickle.NEWOBJ
        + _unicode("posix")
        + _unicode("system")
        + pickle.STACK_GLOBAL
        + _unicode(cmd)
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.BUILD
    )
    out["newobj"] = _frame(
        _unicode("subprocess")
        + _unicode("Popen")
        + pickle.STACK_GLOBAL
        + _unicode("touch")
        + _unicode(canary)
        + pickle.TUPLE2
        + pickle.TUPLE1
        + pickle.NEWOBJ
    )
    # copyreg extension codes: EXT4 of a code registered to os.system, and of an
    # unregistered one
    out["ext4-registered"] = _frame(
        pickle.EXT4 + struct.pack("<i", EXT_CODE) + _unicode(cmd) + pickle.TUPLE1 + pickle.REDUCE,
        proto=2,
    )
    out["ext1-unregistered"] = _frame(pickle.EXT1 + b"\x7f" + pickle.EMPTY_TUPLE + pickle.REDUCE, 2)
    out["persid"] = b"P0\n."
    out["binpersid"] = _frame(_unicode("x") + pickle.BINPERSID, 2)
    # builtins.getattr, which an old Python's enum pickles use, reaching past an enum member
    metadata_module = _unicode("torch.distributed.checkpoint.metadata")
    for label, owner, attr in (
        ("allowed-class-attr", "TensorProperties", "__reduce__"),
        ("enum-dunder", "_MEM_FORMAT_ENCODING", "__class__"),
        ("enum-method", "_MEM_FORMAT_ENCODING", "mro"),
    ):
        out[f"getattr-{label}"] = _frame(
            _unicode("builtins")
            + _unicode("getattr")
            + pickle.STACK_GLOBAL
            + metadata_module
            + _unicode(owner)
            + pickle.STACK_GLOBAL
            + _unicode(attr)
            + pickle.TUPLE2
            + pickle.REDUCE
            + _unicode(cmd)
            + pickle.TUPLE1
            + pickle.REDUCE
        )
    # ... and a real route to exec with an unchecked getattr: a dataclass's generated
    # __init__ -> its module's globals -> __builtins__ -> exec
    getattr_ = _unicode("builtins") + _unicode("getattr") + pickle.STACK_GLOBAL

    def attr(obj: bytes, name: str) -> bytes:
        return getattr_ + obj + _unicode(name) + pickle.TUPLE2 + pickle.REDUCE

    def call(fn: bytes, arg: str) -> bytes:
        return fn + _unicode(arg) + pickle.TUPLE1 + pickle.REDUCE

    props = metadata_module + _unicode("TensorProperties") + pickle.STACK_GLOBAL
    globals_get = attr(attr(attr(props, "__init__"), "__globals__"), "get")
    builtins_get = attr(call(globals_get, "__builtins__"), "get")
    out["getattr-walk-to-exec"] = _frame(
        call(call(builtins_get, "exec"), f"open({canary!r}, 'w').close()")
    )
    out["getattr-os-system"] = _frame(
        _unicode("builtins")
        + _unicode("getattr")
        + pickle.STACK_GLOBAL
        + _unicode("os")
        + _unicode("system")
        + pickle.STACK_GLOBAL
        + _unicode("__call__")
        + pickle.TUPLE2
        + pickle.REDUCE
        + _unicode(cmd)
        + pickle.TUPLE1
        + pickle.REDUCE
    )
    # a legit metadata object with a gadget nested inside one of its fields
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    nested = Metadata(
        state_dict_metadata={"w": BytesStorageMetadata()},
        planner_data={"w": ("w",)},
        storage_data={"x": _Reduce(os.system, cmd)},
    )
    out["nested-in-metadata"] = pickle.dumps(nested, protocol=4)
    # torch.load's own format with the gadget inside (a .metadata that is a torch file)
    buf = io.BytesIO()
    torch.save(_Reduce(os.system, cmd), buf)
    out["torch-save-zip"] = buf.getvalue()
    return out


class registered_extension:
    """Context manager: :data:`EXT_CODE` registered to ``os.system`` (as an attacker who
    controls the process's copyreg table would have it)."""

    def __enter__(self) -> None:
        copyreg.add_extension("os", "system", EXT_CODE)

    def __exit__(self, *exc: object) -> None:
        copyreg.remove_extension("os", "system", EXT_CODE)


# -- forging a checkpoint ------------------------------------------------------------------


def refresh_manifest(ckpt_dir: str, changed: dict[str, bytes | None] | None = None) -> None:
    """Recompute manifest.json's size and crc32c of each file in ``changed`` (``None``: its
    current bytes on disk) and COMPLETE's crc32c of the manifest: what an attacker does so
    that the forged checkpoint passes every size and checksum check."""
    manifest_path = os.path.join(ckpt_dir, "manifest.json")
    with open(manifest_path, "rb") as f:
        data = json.loads(f.read())
    for entry in data["files"]:
        if changed is not None and entry["path"] not in changed:
            continue
        path = os.path.join(ckpt_dir, entry["path"])
        with open(path, "rb") as f:  # follows a planted link: the attacker's view
            raw = f.read()
        entry["size"], entry["crc32c"] = len(raw), crc32c_of(raw)
    rewrite_manifest(ckpt_dir, data)


def rewrite_manifest(ckpt_dir: str, data: dict) -> None:
    """Write ``data`` as manifest.json and a COMPLETE that vouches for it."""
    raw = (json.dumps(data, indent=1) + "\n").encode()
    Manifest.from_bytes(raw)  # still a well-formed manifest
    with open(os.path.join(ckpt_dir, "manifest.json"), "wb") as f:
        f.write(raw)
    marker_name = "COMMIT" if os.path.exists(os.path.join(ckpt_dir, "COMMIT")) else "COMPLETE"
    complete = os.path.join(ckpt_dir, marker_name)
    with open(complete, "rb") as f:
        marker = json.loads(f.read())
    marker["manifest_crc32c"] = crc32c_of(raw)
    CompleteMarker.from_bytes(json.dumps(marker).encode())
    with open(complete, "wb") as f:
        f.write(json.dumps(marker).encode())


def plant_metadata(ckpt_dir: str, raw: bytes) -> None:
    """Replace ``.metadata`` with ``raw`` and re-vouch for it."""
    with open(os.path.join(ckpt_dir, ".metadata"), "wb") as f:
        f.write(raw)
    refresh_manifest(ckpt_dir, {".metadata": None})
