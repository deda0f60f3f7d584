"""The benchmark harness imports and answers --help (its timings are never asserted)."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

import bench


@pytest.mark.timeout(120)
def test_every_bench_module_imports_and_help_works():
    for module in pkgutil.iter_modules(bench.__path__):
        if module.name != "__main__":
            importlib.import_module(f"bench.{module.name}")
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "--quick" in result.stdout and "--json" in result.stdout
