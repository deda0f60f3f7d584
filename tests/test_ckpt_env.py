"""ckpt's environment variables: one table, read when used, a clear error for a bad value."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import env

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(60)
def test_import_ckpt_survives_a_bad_value_in_every_variable() -> None:
    # No import-time reads: garbage in every variable must not break `import ckpt`.
    bad = {name: "not-a-number" for name in env.VARIABLES}
    result = subprocess.run(
        [sys.executable, "-c", "import ckpt, ckpt.cli, ckpt.tiers.memory; print('ok')"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env={**_base_env(), **bad},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in env.VARIABLES}


@pytest.mark.timeout(30)
def test_variable_names_live_only_in_the_env_module() -> None:
    # Every CKPT_*/TORCHELASTIC_* name ckpt reads is spelled once, in ckpt/env.py.
    offenders = []
    for path in sorted((REPO_ROOT / "ckpt").rglob("*.py")):  # every subpackage too
        if path.relative_to(REPO_ROOT).as_posix() == "ckpt/env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            value = node.value if isinstance(node, ast.Constant) else None
            if isinstance(value, str) and (value in env.VARIABLES or value.startswith("CKPT_")):
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {value!r}")
    assert not offenders, offenders


@pytest.mark.timeout(30)
def test_bad_values_name_the_variable_and_the_default() -> None:
    with pytest.raises(ValueError, match=r"CKPT_SAVE_BLOCK_BYTES='-4': expected an integer >= 1"):
        env.get_int(env.SAVE_BLOCK_BYTES, 8, minimum=1, env={env.SAVE_BLOCK_BYTES: "-4"})
    with pytest.raises(ValueError, match=r"CKPT_COLLECTIVE_TIMEOUT_S='soon'.*number > 0"):
        env.get_float(
            env.COLLECTIVE_TIMEOUT_S, 600.0, positive=True, env={env.COLLECTIVE_TIMEOUT_S: "soon"}
        )
    with pytest.raises(ValueError, match="TORCHELASTIC_RESTART_COUNT='x'"):
        env.run_identity({env.RUN_ID: "r", env.RESTART_COUNT: "x"})
    assert env.run_identity({}) == ("local", 0)
    assert env.run_identity({env.RUN_ID: "job7", env.RESTART_COUNT: "2"}) == ("job7", 2)
    assert (
        env.get_float(env.COLLECTIVE_TIMEOUT_S, 600.0, env={env.COLLECTIVE_TIMEOUT_S: " "}) == 600.0
    )


@pytest.mark.timeout(60)
def test_a_bad_nice_value_fails_the_save_call_not_the_background_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env.SAVE_THREAD_NICE, "very")
    state = {"w": torch.arange(4.0)}
    with pytest.raises(ValueError, match="CKPT_SAVE_THREAD_NICE='very'"):
        ckpt.save(state, str(tmp_path), step=1, async_save=True)
    monkeypatch.setenv(env.SAVE_THREAD_NICE, "5")
    ckpt.save(state, str(tmp_path), step=2, async_save=True).wait(60)
    ckpt.wait_pending()
    assert [info.step for info in ckpt.list_checkpoints(str(tmp_path))] == [2]
