"""The `elastic` package surface: exports, dependencies, import cost."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import elastic

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
def test_never_imports_trainer_or_ckpt() -> None:
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
                assert top not in {"trainer", "ckpt"}, f"{path.name} imports {module}"


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
