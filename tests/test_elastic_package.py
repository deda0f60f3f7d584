"""The `elastic` package surface: exports, dependencies, import cost, what it ships."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools

import elastic

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(30)
def test_every_exported_name_resolves() -> None:
    for name in elastic.__all__:
        module = importlib.import_module(elastic._EXPORTS[name])
        assert getattr(elastic, name) is getattr(module, name)
    assert sorted(elastic.__all__) == sorted(elastic._EXPORTS)
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = elastic.no_such_name  # type: ignore[attr-defined]


@pytest.mark.timeout(30)
def test_never_imports_trainer_ckpt_or_testing() -> None:
    for path in (REPO_ROOT / "elastic").glob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                assert top not in {"trainer", "ckpt", "testing"}, f"{path.name} imports {module}"


@pytest.mark.timeout(30)
def test_harnesses_live_in_the_unshipped_testing_package() -> None:
    # The local torchrun cluster and the gloo rank spawner are test/bench harnesses: no
    # runtime path of the trainer imports them. The tests import them from `testing/`,
    # which is not installed; the implementations the bench runs ship inside `bench`.
    modules = {path.stem for path in (REPO_ROOT / "elastic").glob("*.py")}
    assert {"local_cluster", "spawn"}.isdisjoint(modules), modules
    for name in ("local_cluster", "spawn", "gcs_emulator", "ports"):
        assert (REPO_ROOT / "testing" / f"{name}.py").is_file(), name
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = setuptools.find_packages(str(REPO_ROOT), include=include)
    assert "elastic" in shipped
    assert not [name for name in shipped if name.split(".")[0] in {"testing", "tests"}], shipped


@pytest.mark.timeout(60)
def test_signal_fault_and_watchdog_modules_do_not_import_torch() -> None:
    code = (
        "import sys, json\n"
        "import elastic.faults, elastic.identity, elastic.preemption, elastic.watchdog\n"
        "print(json.dumps('torch' in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) is False
