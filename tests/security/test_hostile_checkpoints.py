"""A checkpoint is data, never code: hostile and malformed checkpoints through every entry point.

Each entry point (``python -m ckpt verify`` in its three modes, ``inspect``, ``ls``,
``gc``, ``export``, ``ckpt.load`` as a resume, and a memory-tier resume) runs in a
process of its own under an audit hook (``audited.py``) over a sandbox::

    sandbox/root/          the checkpoint root under test
    sandbox/outside/       a decoy file and another root's committed checkpoint
    sandbox/CANARY         what every gadget would create

and the test asserts the refusal (exit code, fallback), that the canary never appears,
that no process or command was started, and that nothing outside the root was opened,
listed, written or removed (every path checked through ``realpath``, so reading through a
planted symbolic link counts as reading its target).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from corpus import (
    hostile_pickles,
    plant_metadata,
    refresh_manifest,
    registered_extension,
    rewrite_manifest,
)

import ckpt.cli
import ckpt.errors
from ckpt.errors import CorruptCheckpointError
from ckpt.format.dcp_metadata import decode_metadata

AUDITED = os.path.join(os.path.dirname(__file__), "audited.py")
SPAWNS = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.fork"}
WRITES = {
    "os.remove", "os.rmdir", "os.rename", "os.replace", "shutil.rmtree", "shutil.move",
    "os.symlink", "os.link", "os.truncate", "os.chmod", "os.chown", "os.mkdir", "os.utime",
}  # fmt: skip
READS = {"open", "os.listdir", "os.scandir"}


def _state(step: int) -> dict:
    return {"w": torch.arange(64, dtype=torch.float32) + step, "step": step}


def _template() -> dict:
    return {"w": torch.zeros(64), "step": -1}


class Sandbox:
    def __init__(self, base: str) -> None:
        self.base = base
        self.root = os.path.join(base, "root")
        self.outside = os.path.join(base, "outside")
        self.canary = os.path.join(base, "CANARY")
        os.makedirs(self.outside)
        self.secret = os.path.join(self.outside, "secret.bin")
        with open(self.secret, "wb") as f:
            f.write(b"not yours to read\n" * 65536)
        self.other_root = os.path.join(self.outside, "other_root")
        ckpt.save(_state(5), self.other_root, 5)

    def ckpt_dir(self, step: int, root: str | None = None) -> str:
        return os.path.join(root or self.root, f"checkpoint_{step:07d}")

    def run(self, code: str, *, writable: tuple[str, ...] = ()) -> object:
        """Run ``code`` audited; assert containment; return its ``result``."""
        log = os.path.join(self.base, f"audit-{os.getpid()}-{len(os.listdir(self.base))}.log")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.run(
            [sys.executable, AUDITED, log, code],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
            cwd=self.base,
        )
        assert proc.returncode == 0, f"audited run failed:\n{proc.stdout}\n{proc.stderr}"
        with open(log) as f:
            events = [json.loads(line) for line in f]
        os.remove(log)
        self.assert_contained(events, writable=(self.root, *writable))
        self.last_stderr = proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def assert_contained(self, events: list[list[str]], *, writable: tuple[str, ...]) -> None:
        assert not os.path.exists(self.canary), "a gadget ran: the canary exists"
        spawned = [e for e in events if e[0] in SPAWNS]
        assert not spawned, f"processes or commands were started: {spawned[:3]}"
        inside = [os.path.realpath(p) + os.sep for p in writable]
        outside_touched = []
        for event, *args in events:
            paths = [a for a in args[:2] if isinstance(a, str) and a.startswith(self.base)]
            opened_to_write = (
                event == "open" and len(args) > 1 and any(c in args[1] for c in "wax+")
            )
            if event in READS and not opened_to_write:
                kind = "read"
            elif event in WRITES or opened_to_write:
                kind = "write"
            else:
                continue
            for path in paths:
                real = os.path.realpath(path) + os.sep
                beyond = real.startswith(os.path.realpath(self.outside) + os.sep)
                if beyond or (kind == "write" and not any(real.startswith(w) for w in inside)):
                    outside_touched.append((event, path, real))
        assert not outside_touched, f"touched outside the root: {outside_touched[:5]}"


@pytest.fixture
def sandbox(tmp_path) -> Sandbox:
    return Sandbox(str(tmp_path))


# -- the pickle corpus ---------------------------------------------------------------------


def test_every_gadget_is_refused_by_the_decoder_itself(tmp_path):
    canary = str(tmp_path / "CANARY")
    corpus = hostile_pickles(canary)
    assert len(corpus) >= 20
    for name, raw in corpus.items():
        with (
            registered_extension(),
            pytest.raises(CorruptCheckpointError, match=r"\.metadata") as refused,
        ):
            decode_metadata(raw, url=f"gadget:{name}")
        assert "gadget:" in str(refused.value)
    assert not os.path.exists(canary)
    # The dotted names are real routes to os.system, not strings that fail anyway: an
    # unpickler that walks attributes from an allowed module (the earlier allowlist) finds it.
    dotted = {n: raw for n, raw in corpus.items() if n.startswith("dotted-")}
    assert len(dotted) >= 4

    class Walking(pickle.Unpickler):
        def find_class(self, module, name):
            found = super().find_class(module, name)
            raise LookupError(found)

    for raw in dotted.values():
        with pytest.raises(LookupError) as walked:
            Walking(__import__("io").BytesIO(raw)).load()
        assert walked.value.args[0] is os.system


def _hostile_root(sandbox: Sandbox) -> list[int]:
    """Step 1 is sound; each later step holds one gadget as its .metadata."""
    ckpt.save(_state(1), sandbox.root, 1)
    steps = []
    for i, raw in enumerate(hostile_pickles(sandbox.canary).values(), start=2):
        ckpt.save(_state(i), sandbox.root, i)
        plant_metadata(sandbox.ckpt_dir(i), raw)
        steps.append(i)
    return steps


CLI = """
import ckpt.cli, contextlib, io
result = []
for argv in ARGVS:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = ckpt.cli.main(argv)
    result.append([code, out.getvalue()])
"""


def _cli(sandbox: Sandbox, argvs: list[list[str]], **kw) -> list[tuple[int, str]]:
    return sandbox.run(f"ARGVS = {argvs!r}\n{CLI}", **kw)


@pytest.mark.parametrize("mode", [[], ["--fast"], ["--deep"]])
def test_verify_fails_every_hostile_metadata_in_every_mode(sandbox, mode):
    steps = _hostile_root(sandbox)
    results = _cli(sandbox, [["verify", sandbox.root, "--step", str(s), *mode] for s in steps])
    for step, (code, out) in zip(steps, results):
        assert code == 1, f"step {step}: {out}"
        assert out.startswith("FAIL") and ".metadata" in out and "OK" not in out.split()[0]
    good = _cli(sandbox, [["verify", sandbox.root, "--step", "1", *mode]])
    assert good[0][0] == 0 and good[0][1].startswith("OK")


def test_inspect_ls_gc_and_export_refuse_or_ignore_hostile_metadata(sandbox):
    steps = _hostile_root(sandbox)
    out_dir = os.path.join(sandbox.base, "exported")
    argvs = [["inspect", sandbox.root, "--step", str(s)] for s in steps]
    argvs += [["export", sandbox.root, f"{out_dir}-{s}", "--step", str(s)] for s in steps]
    argvs += [["ls", sandbox.root], ["gc", sandbox.root, "--keep-last", "1000", "--quarantined"]]
    results = _cli(sandbox, argvs, writable=(sandbox.base,))
    n = len(steps)
    for step, (code, out) in zip(steps, results[:n]):
        assert code == 2 and ".metadata" in out, f"inspect step {step}: {out}"
    for step, (code, out) in zip(steps, results[n : 2 * n]):
        assert code == 2 and ".metadata" in out, f"export step {step}: {out}"
        assert not os.path.exists(f"{out_dir}-{step}")
    ls_code, ls_out = results[-2]
    assert ls_code == 0 and f"{len(steps) + 1} committed" in ls_out
    gc_code, gc_out = results[-1]
    assert gc_code == 0 and f"{len(steps) + 1} kept, 0 deleted" in gc_out
    assert sorted(os.listdir(sandbox.root)) == [f"checkpoint_{s:07d}" for s in (1, *steps)]


def test_a_resume_quarantines_every_hostile_checkpoint_and_loads_the_sound_one(sandbox):
    steps = _hostile_root(sandbox)
    code = f"""
import ckpt, torch
state = {{"w": torch.zeros(64), "step": -1}}
r = ckpt.load(state, {sandbox.root!r})
result = [r.step, [s.step for s in r.skipped], state["step"], float(state["w"][0])]
"""
    step, skipped, loaded_step, w0 = sandbox.run(code)
    assert (step, loaded_step, w0) == (1, 1, 1.0)
    assert sorted(skipped) == steps
    names = os.listdir(sandbox.root)
    assert "checkpoint_0000001" in names
    assert len([n for n in names if ".quarantined-" in n]) == len(steps)
    # the relaunch finds the sound checkpoint at once and the quarantined ones stay aside
    again = ckpt.load(_template(), sandbox.root)
    assert again.step == 1 and not again.skipped


def test_a_memory_tier_resume_refuses_hostile_snapshot_metadata_and_falls_back(sandbox):
    memdir = os.path.join(sandbox.base, "mem")
    gadgets = hostile_pickles(sandbox.canary)
    for name in ("reduce-os-system-p5", "dotted-torch", "nested-in-metadata"):
        root = os.path.join(sandbox.base, f"root-{name}")
        model = torch.nn.Linear(8, 8)
        manager = ckpt.CheckpointManager(root, {"model": model}, memory_every=1, memory_dir=memdir)
        manager.save(1)
        with torch.no_grad():
            model.weight.add_(1.0)
        manager.maybe_save(2)  # a memory snapshot, newer than the durable checkpoint
        manager.close()
        slots = [
            os.path.join(dirpath)
            for dirpath, _, files in os.walk(memdir)
            if "COMMIT" in files and root_key(root) in dirpath
        ]
        assert slots, "no committed memory snapshot to forge"
        for slot in slots:
            plant_metadata(slot, gadgets[name])
        code = f"""
import ckpt, torch
model = torch.nn.Linear(8, 8)
m = ckpt.CheckpointManager({root!r}, {{"model": model}}, memory_every=1, memory_dir={memdir!r})
step = m.resume()
result = [step, m.last_resume.tier]
m.close()
"""
        assert sandbox.run(code, writable=(root, memdir)) == [1, "durable"], name


def root_key(root: str) -> str:
    from ckpt.tiers.memory.layout import run_key

    return run_key("local", root)


# -- confinement: paths, checksums, links, sizes, malformed entries --------------------------


def _metadata_of(ckpt_dir: str):
    with open(os.path.join(ckpt_dir, ".metadata"), "rb") as f:
        return pickle.loads(f.read())  # our own sound checkpoint, written by this test


def _forged(sandbox: Sandbox) -> dict[int, str]:
    """Step -> what was forged; step 1 is sound."""
    ckpt.save(_state(1), sandbox.root, 1)
    cases = {}

    def save(step: int, what: str) -> str:
        ckpt.save(_state(step), sandbox.root, step)
        cases[step] = what
        return sandbox.ckpt_dir(step)

    # an item path out of the checkpoint, to the decoy
    d = save(2, "item path outside")
    md = _metadata_of(d)
    escape = os.path.relpath(sandbox.secret, d)
    for info in md.storage_data.values():
        info.relative_path = escape
    plant_metadata(d, pickle.dumps(md))
    # an item with no checksum in the manifest
    d = save(3, "item without crc32c")
    with open(os.path.join(d, "manifest.json")) as f:
        data = json.load(f)
    data["chunks"]["rank_00000.distcp"] = data["chunks"]["rank_00000.distcp"][1:]
    rewrite_manifest(d, data)
    # an item 1 TB long
    d = save(4, "item of 1 TB")
    md = _metadata_of(d)
    for info in md.storage_data.values():
        info.length = 1 << 40
    plant_metadata(d, pickle.dumps(md))
    # the shard replaced by a link to the decoy (sizes and checksums recomputed through it)
    d = save(5, "shard is a symlink")
    os.remove(os.path.join(d, "rank_00000.distcp"))
    os.symlink(sandbox.secret, os.path.join(d, "rank_00000.distcp"))
    refresh_manifest(d, {"rank_00000.distcp": None})
    # a 2 GiB (sparse) .metadata, listed with its size
    d = save(6, "huge .metadata")
    os.truncate(os.path.join(d, ".metadata"), 2 << 30)
    with open(os.path.join(d, "manifest.json")) as f:
        data = json.load(f)
    for entry in data["files"]:
        if entry["path"] == ".metadata":
            entry["size"] = 2 << 30
    rewrite_manifest(d, data)
    # .metadata a link to the other root's (valid!) metadata
    d = save(7, ".metadata is a symlink")
    os.remove(os.path.join(d, ".metadata"))
    os.symlink(
        os.path.join(sandbox.ckpt_dir(5, sandbox.other_root), ".metadata"),
        os.path.join(d, ".metadata"),
    )
    refresh_manifest(d, {".metadata": None})
    # an uncommitted directory whose COMPLETE is JSON nested 100k deep
    deep = sandbox.ckpt_dir(8)
    os.makedirs(deep)
    with open(os.path.join(deep, "COMPLETE"), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    # a plain file, and a link to a directory, named like checkpoints
    with open(sandbox.ckpt_dir(9), "w") as f:
        f.write("not a checkpoint")
    os.symlink(sandbox.ckpt_dir(5, sandbox.other_root), sandbox.ckpt_dir(10))
    return cases


def test_verify_names_each_forgery_and_reads_nothing_outside(sandbox):
    cases = _forged(sandbox)
    steps = sorted(cases)
    results = _cli(
        sandbox, [["verify", sandbox.root, "--step", str(s), "--deep"] for s in [*steps, 10]]
    )
    why = {
        2: "not a shard file",
        3: "no crc32c",
        4: "claims bytes",
        5: "symbolic link",
        6: "more than",
        7: "not a regular file",
    }
    for step, (code, out) in zip([*steps, 10], results):
        assert code == 1 and out.startswith("FAIL"), f"step {step}: {out}"
        expected = why.get(step, "symbolic link")
        assert expected in out or "not a regular file" in out, f"step {step}: {out}"


def test_ls_and_gc_list_forgeries_without_crashing_or_deleting_them(sandbox):
    cases = _forged(sandbox)
    before = sorted(os.listdir(sandbox.root))
    (ls_code, ls_out), (_, js_out), (gc_code, _) = _cli(
        sandbox,
        [
            ["ls", sandbox.root],
            ["ls", sandbox.root, "--json"],
            ["gc", sandbox.root, "--keep-last", "1", "--quarantined"],
        ],
    )
    assert ls_code == 0 and "foreign" in ls_out and "partial" in ls_out
    rows = json.loads(js_out)
    assert {r.get("name") for r in rows if r["status"] == "foreign"} >= {
        "checkpoint_0000009",
        "checkpoint_0000010",
    }
    assert gc_code == 0
    after = sorted(os.listdir(sandbox.root))
    # the deep-JSON partial (no record of a run) and the foreign entries are left in place
    for name in ("checkpoint_0000008", "checkpoint_0000009", "checkpoint_0000010"):
        assert name in after
    assert os.path.isfile(os.path.join(sandbox.ckpt_dir(5, sandbox.other_root), "COMPLETE"))
    assert set(after) <= set(before)
    assert len(cases) == 6


def test_a_resume_sets_every_forgery_aside_and_loads_the_sound_checkpoint(sandbox):
    cases = _forged(sandbox)
    code = f"""
import ckpt, torch
state = {{"w": torch.zeros(64), "step": -1}}
r = ckpt.load(state, {sandbox.root!r})
result = [r.step, sorted(s.step for s in r.skipped), state["step"]]
"""
    step, skipped, loaded = sandbox.run(code)
    assert (step, loaded) == (1, 1)
    assert skipped == sorted(cases)
    # the other root's checkpoint, linked in as step 10, was never loaded nor touched
    assert os.path.isfile(os.path.join(sandbox.ckpt_dir(5, sandbox.other_root), "COMPLETE"))


def test_export_of_a_forgery_fails_without_allocating_or_reading_outside(sandbox):
    _forged(sandbox)
    out = os.path.join(sandbox.base, "out")
    results = _cli(
        sandbox,
        [["export", sandbox.root, f"{out}{s}", "--step", str(s)] for s in (2, 3, 4, 5, 6, 7)],
        writable=(sandbox.base,),
    )
    for step, (code, text) in zip((2, 3, 4, 5, 6, 7), results):
        assert code == 2 and "error:" in text, f"step {step}: {text}"
        assert "MemoryError" not in text and not os.path.exists(f"{out}{step}")


# -- saved but never loadable: refused at save ------------------------------------------------


def test_values_a_resume_cannot_load_are_refused_at_save_before_anything_is_written(tmp_path):
    import datetime

    root = str(tmp_path / "root")
    for bad, kind in ((datetime.date(2026, 1, 1), "datetime.date"), (object(), "object")):
        with pytest.raises(ckpt.errors.UnsupportedStateError, match=rf"state\[extra\].*{kind}"):
            ckpt.save({"w": torch.ones(2), "extra": bad}, root, 1)
        assert not os.path.exists(root) or os.listdir(root) == []


def test_numpy_values_are_saved_exactly_and_load_back_as_numpy(tmp_path):
    np = pytest.importorskip("numpy")
    root = str(tmp_path / "root")
    saved = {
        "i": np.int64(2**40 + 3),
        "f": np.float32(1.1),
        "b": np.bool_(True),
        "a": np.arange(12, dtype=np.float64).reshape(3, 4) / 7,
        "nested": {"n": np.int32(-5)},
    }
    ckpt.save(saved, root, 1)
    assert not os.path.exists(os.path.join(root, "checkpoint_0000001", "ATTEMPT"))
    array = np.zeros((3, 4))
    state = {
        "i": np.int64(0),
        "f": np.float32(0),
        "b": np.bool_(False),
        "a": array,
        "nested": {"n": np.int32(0)},
    }
    ckpt.load(state, root)
    assert type(state["i"]) is np.int64 and state["i"] == 2**40 + 3
    assert type(state["f"]) is np.float32 and state["f"] == np.float32(1.1)
    assert type(state["b"]) is np.bool_ and bool(state["b"])
    assert state["a"] is array and np.array_equal(array, saved["a"])
    assert type(state["nested"]["n"]) is np.int32 and state["nested"]["n"] == -5


def test_a_value_that_fails_to_decode_quarantines_its_checkpoint(tmp_path, monkeypatch):
    """An item that does not decode (a gadget in a byte item) is damage: set aside, not a loop."""
    import ckpt.saving.commit as commit_module

    root = str(tmp_path / "root")
    canary = str(tmp_path / "CANARY")
    ckpt.save({"w": torch.ones(2), "extra": 1}, root, 1)
    # Bypass the save-time check to write what an attacker would: a byte item whose
    # pickle calls os.system.
    from corpus import _Reduce

    monkeypatch.setattr(commit_module, "checked_state", lambda state: state)
    ckpt.save({"w": torch.ones(2), "extra": _Reduce(os.system, f"touch {canary}")}, root, 2)
    monkeypatch.undo()
    state = {"w": torch.zeros(2), "extra": 0}
    result = ckpt.load(state, root)
    assert result.step == 1 and [s.step for s in result.skipped] == [2]
    assert "cannot be decoded" in result.skipped[0].reason
    assert not os.path.exists(canary)
    assert any(".quarantined-" in n for n in os.listdir(root))
    ckpt.save({"w": torch.ones(2), "extra": 3}, root, 2)  # the step can be saved again


def test_a_shared_checkpoint_copied_with_shutil_keeps_working(tmp_path):
    """The checks do not get in the way of a legit copy of a checkpoint to another root."""
    root = str(tmp_path / "a")
    ckpt.save(_state(3), root, 3)
    shutil.copytree(root, str(tmp_path / "b"))
    assert ckpt.load(_template(), str(tmp_path / "b")).step == 3


def test_a_tensor_declared_smaller_than_its_stored_item_fails_verify_and_is_set_aside(tmp_path):
    # Declared shapes are tied to the stored bytes both ways: a 400 KB item that its
    # .metadata calls 10 x 100 floats (4 KB) is a forgery, not a tensor with a long header.
    root = str(tmp_path / "root")
    ckpt.save({"w": torch.ones(1000, 100), "step": 1}, root, 1)
    ckpt.save({"w": torch.ones(1000, 100) * 2, "step": 2}, root, 2)
    d = os.path.join(root, "checkpoint_0000002")
    md = _metadata_of(d)
    tensor = md.state_dict_metadata["w"]
    tensor.size = torch.Size([10, 100])
    for chunk in tensor.chunks:
        chunk.sizes = torch.Size([10, 100])
    plant_metadata(d, pickle.dumps(md))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = ckpt.cli.main(["verify", root, "--step", "2", "--deep"])
    assert code == 1 and "is stored in" in out.getvalue(), out.getvalue()
    state = {"w": torch.zeros(1000, 100), "step": -1}
    result = ckpt.load(state, root)
    assert result.step == 1 and [s.step for s in result.skipped] == [2]
