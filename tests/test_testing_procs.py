"""testing.procs.run_bounded: a command past its deadline leaves its stacks behind."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from testing.procs import RunTimeoutError, run_bounded

CHILD = textwrap.dedent(
    """
    import subprocess, sys, time
    def the_parent_waits_here():
        subprocess.run([sys.executable, "-c", "import time\\ndef the_child_waits_here():\\n"
                        "    time.sleep(60)\\nthe_child_waits_here()"])
    print("started", flush=True)
    the_parent_waits_here()
    """
)


@pytest.mark.timeout(60)
def test_a_hung_tree_is_killed_and_says_where_each_process_hung(tmp_path):
    with pytest.raises(RunTimeoutError) as caught:
        run_bounded(
            [sys.executable, "-c", CHILD], env=dict(os.environ), cwd=str(tmp_path), timeout_s=3
        )
    out = caught.value.output
    assert "started" in out
    assert "the_parent_waits_here" in out and "the_child_waits_here" in out
