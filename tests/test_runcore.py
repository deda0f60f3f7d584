"""runcore: the layer under ckpt and elastic (fault-spec grammar, event schema).

The layering (ckpt never imports elastic, runcore imports nothing of the repository),
writers using the schema's names, and the events a real run writes matching it.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_ckpt_core import _corrupt_flip

from elastic.events import RunRecorder
from runcore import events as ev
from runcore.faultspec import split_fault_spec

REPO_ROOT = Path(__file__).resolve().parents[1]
REPO_PACKAGES = {"ckpt", "elastic", "trainer", "bench", "testing", "warmstart", "runcore", "tests",
                 "integrations"}  # fmt: skip


def _imports(package: str) -> dict[str, set[str]]:
    """Top-level module names each file of ``package`` (its subpackages too) imports
    (anywhere in the file), by the file's path inside the package."""
    out: dict[str, set[str]] = {}
    for path in sorted((REPO_ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add((node.module or "").split(".")[0])
        out[path.relative_to(REPO_ROOT / package).as_posix()] = names
    return out


@pytest.mark.timeout(30)
def test_ckpt_never_imports_elastic_trainer_or_testing() -> None:
    bad = {f: n & {"elastic", "trainer", "testing"} for f, n in _imports("ckpt").items()}
    assert not {f: n for f, n in bad.items() if n}, bad


@pytest.mark.timeout(30)
def test_integrations_rest_on_ckpt_and_elastic_and_nothing_imports_them() -> None:
    # A plug-in is a user of the public API; its framework (Lightning...) stays optional
    for name, imported in _imports("integrations").items():
        inside = imported & REPO_PACKAGES
        assert inside <= {"ckpt", "elastic", "integrations"}, f"integrations/{name}: {inside}"
    for package in ("ckpt", "elastic", "trainer", "runcore", "warmstart", "bench"):
        users = [f for f, n in _imports(package).items() if "integrations" in n]
        assert not users, f"{package} imports integrations: {users}"


@pytest.mark.timeout(30)
def test_warmstart_is_standard_library_only() -> None:
    # Its zygote outlives workers: it must not hold (stale) code of ckpt, elastic, trainer
    # beyond what it is told to preload (and then watches for changes).
    for name, imported in _imports("warmstart").items():
        outside = imported - {"warmstart"} - sys.stdlib_module_names
        assert not outside, f"warmstart/{name} imports {outside}"


@pytest.mark.timeout(30)
def test_runcore_is_standard_library_only() -> None:
    for name, imported in _imports("runcore").items():
        outside = imported - {"runcore"} - sys.stdlib_module_names
        assert not outside, f"runcore/{name} imports {outside}"
        assert not (imported & (REPO_PACKAGES - {"runcore"})), name


@pytest.mark.timeout(30)
def test_the_grammar_splits_name_and_fields_and_names_the_fault() -> None:
    assert split_fault_spec(" kill : step=3 :rank=1 ") == ("kill", {"step": "3", "rank": "1"})
    with pytest.raises(ValueError, match="'step' is not key=value"):
        split_fault_spec("kill:step")
    with pytest.raises(ValueError, match="key 'rank' given twice"):
        split_fault_spec("kill:rank=1:rank=2")


class _EventNameLiterals(ast.NodeVisitor):
    """Schema names spelled as string literals where an event is written or compared."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if called in {"event", "_emit", "on_event"} and node.args:
            self._check(node.args[0], node.lineno)
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for key, value in zip(node.keys, node.values, strict=True):
            if isinstance(key, ast.Constant) and key.value == "event":
                self._check(value, node.lineno)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        for side in (node.left, *node.comparators):
            self._check(side, node.lineno)
        self.generic_visit(node)

    def _check(self, node: ast.AST, line: int) -> None:
        if isinstance(node, ast.Constant) and node.value in ev.SCHEMA:
            self.found.append(f"line {line}: {node.value!r}")


@pytest.mark.timeout(30)
def test_writers_and_readers_use_the_schema_names_not_literals() -> None:
    offenders = {}
    for package in ("ckpt", "elastic", "trainer", "bench"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            visitor = _EventNameLiterals()
            visitor.visit(ast.parse(path.read_text(), filename=str(path)))
            if visitor.found:
                offenders[str(path.relative_to(REPO_ROOT))] = visitor.found
    assert not offenders, offenders


@pytest.mark.timeout(30)
def test_a_known_event_missing_a_field_is_written_and_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = RunRecorder(str(tmp_path), rank=0)
    with caplog.at_level(logging.WARNING, logger="elastic.events"):
        recorder.event(ev.FAULT, 3)  # no spec, no rank given (rank is added)
        recorder.event(ev.FAULT, 4)
        recorder.event("my_own_event", 5)  # outside the schema: fine
    recorder.close()
    said = [r.getMessage() for r in caplog.records]
    assert said == ["run log: event 'fault' lacks field(s) spec of its schema (runcore/events.py)"]
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [3, 4, 5]


SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import ckpt
    import elastic

    root, run_dir, max_steps, faults = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    log = elastic.RunRecorder(run_dir, rank=0)
    manager = ckpt.CheckpointManager(root, state, every=2, on_event=log.event)
    with manager, elastic.RunGuard(saver=manager, faults=faults, watchdog_s=0,
                                   on_event=log.event) as guard:
        start = manager.resume() or 0
        for step in guard.steps(start, max_steps):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            manager.maybe_save(step, final=step == max_steps)
    """
)


@pytest.mark.timeout(240)
def test_the_events_of_a_real_run_match_the_schema(tmp_path: Path) -> None:
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    root, run_dir = str(tmp_path / "checkpoints"), str(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.pop("TRAINER_FAULTS", None)
    env.pop("CKPT_STORAGE_FAULTS", None)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(script), root, run_dir, *args],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    first = run("6")
    assert first.returncode == 0, first.stderr
    _corrupt_flip(root, "checkpoint_0000006/rank_00000.distcp")
    second = run("10", "sigterm:step=8", "fault_kind_that_does_not_exist:step=99")
    assert second.returncode != 0  # an unknown fault kind is refused at start ...
    assert "fault_kind_that_does_not_exist" in second.stderr
    second = run("10", "sigterm:step=8")  # ... and a good one runs
    assert second.returncode == 143, second.stderr

    records = [json.loads(line) for line in Path(run_dir, "events.jsonl").read_text().splitlines()]
    names = {r["event"] for r in records}
    expected = {ev.CHECKPOINT_SAVED, ev.FALLBACK, ev.QUARANTINE, ev.CHECKPOINT_LOADED, ev.RESUME}
    assert expected | {ev.FAULT, ev.PREEMPTED} <= names, names
    incomplete = {r["event"]: ev.missing_fields(r) for r in records if ev.missing_fields(r)}
    assert not incomplete, incomplete
    assert "lacks field" not in first.stderr + second.stderr


def test_a_job_ending_error_is_deterministic_and_found_through_its_causes():
    from runcore.errors import DeterministicError, JobEndingError, ends_the_job, is_deterministic

    class Refused(JobEndingError):
        pass

    class Plain(DeterministicError):
        pass

    try:
        try:
            raise Refused("root held")
        except Refused as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert ends_the_job(outer) and is_deterministic(outer)
    assert is_deterministic(Plain()) and not ends_the_job(Plain())
