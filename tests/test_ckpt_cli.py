"""python -m ckpt: output a person can read, and exit codes a script can use."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import ckpt
from ckpt.cli import human_bytes, main
from ckpt.storage import Storage

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def populated(tmp_root):
    for step in (10, 20, 30):
        ckpt.save(
            {"w": torch.randn(64, 64), "step": step},
            tmp_root,
            step,
            metadata={"tokens": step * 100},
        )
    # A partial save of step 40: a process killed before writing COMPLETE (a save that
    # fails in a living process removes its directory itself).
    ckpt.save({"w": torch.randn(64, 64), "step": 40}, tmp_root, 40)
    Storage(tmp_root).remove("checkpoint_0000040/COMPLETE")
    return tmp_root


@pytest.mark.parametrize(
    ("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (5 * 2**30, "5.0 GiB")]
)
def test_human_bytes(n, text):
    assert human_bytes(n) == text


def test_ls_lists_committed_and_partial_newest_first(populated, capsys):
    assert main(["ls", populated]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["STEP", "STATUS", "SIZE", "WORLD", "CREATED", "NOTE"]
    rows = [line.split() for line in lines[1:5]]
    assert [(r[0], r[1]) for r in rows] == [
        ("40", "partial"),
        ("30", "committed"),
        ("20", "committed"),
        ("10", "committed"),
    ]
    assert "KiB" in lines[2] and "no COMPLETE" in lines[1]
    assert lines[-1].startswith("3 committed, 1 partial")
    assert main(["ls", "--json", populated]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["status"] for d in data] == ["partial", "committed", "committed", "committed"]


def test_verify_exit_codes(populated, capsys):
    assert main(["verify", populated]) == 0
    assert capsys.readouterr().out.startswith("OK    ")
    assert main(["verify", "--deep", "--step", "20", populated]) == 0
    assert main(["verify", "--step", "40", populated]) == 1  # partial: not committed
    assert "not committed" in capsys.readouterr().out
    flip_byte(os.path.join(populated, "checkpoint_0000030", "rank_00000.distcp"))
    assert main(["verify", "--fast", populated]) == 0  # same size, no object crc on local disk
    assert "sizes only" in capsys.readouterr().out
    assert main(["verify", "--deep", populated]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL") and "rank_00000.distcp" in out and "crc32c" in out
    assert main(["verify", os.path.join(populated, "checkpoint_0000010")]) == 0  # a directory URL


def flip_byte(path, offset=300):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_default_verify_of_a_clean_local_checkpoint_checks_contents(populated, capsys):
    assert main(["verify", populated]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK    ") and "sizes only" not in out
    checked = int(re.search(r"(\d+) crc32c checked", out).group(1))
    files = len(ckpt.find_latest_committed(populated).manifest.files)
    assert checked == files > 0
    assert "checksum: " in out and " 0 B read" not in out


def test_default_verify_fails_on_a_flipped_byte_and_names_the_file(populated, capsys):
    flip_byte(os.path.join(populated, "checkpoint_0000030", "rank_00000.distcp"))
    assert main(["verify", populated]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL") and "OK" not in out
    assert "rank_00000.distcp" in out and "crc32c" in out
    assert main(["verify", "--step", "20", populated]) == 0  # the other steps are intact
    capsys.readouterr()
    # The module entry point, as a person runs it.
    result = subprocess.run(
        [sys.executable, "-m", "ckpt", "verify", populated],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rank_00000.distcp" in result.stdout


def test_fast_verify_says_sizes_only(populated, capsys):
    flip_byte(os.path.join(populated, "checkpoint_0000030", "rank_00000.distcp"))
    assert main(["verify", "--fast", populated]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK (sizes only, contents not checked) ")
    assert "0 crc32c checked" in out and "fast: " in out
    with pytest.raises(SystemExit) as exc:  # argparse: --fast and --deep exclude each other
        main(["verify", "--fast", "--deep", populated])
    assert exc.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


def test_verify_and_inspect_of_an_empty_root_exit_1(tmp_root, capsys):
    os.makedirs(tmp_root, exist_ok=True)
    assert main(["verify", tmp_root]) == 1
    assert "no committed checkpoint" in capsys.readouterr().err
    assert main(["inspect", tmp_root]) == 1


def test_a_root_that_does_not_exist_is_an_error_not_an_empty_root(tmp_path, capsys):
    typo = str(tmp_path / "no-such-root")
    for command in ("ls", "verify", "inspect"):
        assert main([command, typo]) == 2, command
        assert f"checkpoint root {typo!r} does not exist" in capsys.readouterr().err
    assert not os.path.exists(typo)  # nothing was created


def test_inspect_shows_manifest_summary(populated, capsys):
    assert main(["inspect", populated]) == 0
    out = capsys.readouterr().out
    assert "step         30" in out and "world_size   1" in out
    assert "float32" in out and "[64, 64]" in out and '"tokens": 3000' in out
    assert main(["inspect", "--json", "--step", "20", populated]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (
        data["step"] == 20
        and {"name": "w", "shape": [64, 64], "dtype": "float32"} in data["tensors"]
    )


def test_gc_dry_run_then_delete(populated, capsys):
    assert main(["gc", populated, "--keep-last", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete  step         20" in out and "nothing was deleted" in out
    assert len(ckpt.list_checkpoints(populated)) == 4
    assert main(["gc", populated, "--keep-last", "1", "--keep-every", "20"]) == 0
    assert [(i.step, i.committed) for i in ckpt.list_checkpoints(populated)] == [
        (40, False),
        (30, True),
        (20, True),
    ]


def test_gc_rejects_keep_last_zero(populated, capsys):
    assert main(["gc", populated, "--keep-last", "0"]) == 2
    assert "keep_last" in capsys.readouterr().err
    assert len(ckpt.list_checkpoints(populated)) == 4  # nothing deleted


def test_module_entry_point_and_help():
    result = subprocess.run(
        [sys.executable, "-m", "ckpt", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    for command in ("ls", "verify", "inspect", "gc"):
        assert command in result.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "ckpt", "frobnicate"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2


@pytest.mark.parametrize(
    "command",
    [["ls"], ["ls", "--json"], ["inspect"], ["verify"], ["gc", "--dry-run", "--keep-last", "1"]],
    ids=["ls", "ls-json", "inspect", "verify", "gc-dry-run"],
)
def test_a_reader_gone_before_any_output_gets_no_traceback(populated, command):
    """`python -m ckpt ... | head -0`-like: the pipe is closed before the first write.

    With Python's default buffered stdout, a small output is written only at the final
    flush, after the command returned; that flush must be inside the CLI's handling too,
    or Python prints "Exception ignored ... BrokenPipeError" and exits 120.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "ckpt", command[0], populated, *command[1:]],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert result.stderr == "", result.stderr
    assert result.returncode == 0
    assert len(ckpt.list_checkpoints(populated)) == 4  # a dry run deletes nothing


def test_verify_of_a_step_that_never_existed_names_the_committed_ones(populated, capsys):
    assert main(["verify", populated, "--step", "3"]) == 1
    err = capsys.readouterr().err
    assert "no checkpoint of step 3" in err and "committed steps: 10, 20, 30" in err
    assert main(["verify", populated, "--step", "40"]) == 1  # the partial one is still named
    assert "not committed (partial)" in capsys.readouterr().out
