"""elastic.init_distributed: the one process-group setup of the trainer and user scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _run(code: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env.update(extra_env)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env=env,
    )


@pytest.mark.timeout(90)
def test_without_torchrun_a_one_rank_gloo_group_on_the_cpu() -> None:
    code = (
        "import json, elastic, torch.distributed as dist\n"
        "ctx = elastic.init_distributed(timeout_s=30)\n"
        "again = elastic.init_distributed()  # an existing group is kept\n"
        "out = [ctx.rank, ctx.world_size, ctx.backend, str(ctx.device), ctx.is_main,\n"
        "       dist.get_backend(), again.world_size]\n"
        "elastic.close_distributed()\n"
        "out.append(dist.is_initialized())\n"
        "print(json.dumps(out))\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [0, 1, "gloo", "cpu", True, "gloo", 1, False]


@pytest.mark.timeout(90)
def test_a_world_without_a_rendezvous_address_is_refused_naming_the_variables() -> None:
    result = _run("import elastic; elastic.init_distributed()", WORLD_SIZE="2")
    assert result.returncode != 0
    assert "WORLD_SIZE=2 but MASTER_ADDR is not set" in result.stderr
    result = _run("import elastic; elastic.init_distributed(timeout_s=0)")
    assert "timeout_s must be > 0" in result.stderr
