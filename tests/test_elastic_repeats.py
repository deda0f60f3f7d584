"""The note of a deterministic error: merged across the ranks of a node, keyed per launch."""

from __future__ import annotations

import pytest

from elastic.repeats import ErrorNote, RepeatNotes, launch_key, merge_note


def note(restart: int, *, error: str = "CheckpointShapeError", repeated: bool = False) -> ErrorNote:
    return ErrorNote(error, "start-up", "m", restart, repeated)


@pytest.mark.parametrize(
    ("previous", "current", "ends_job", "repeated"),
    [
        (None, note(0), False, False),
        (None, note(0), True, True),  # a job-ending error: at its first occurrence
        (note(0), note(1), False, True),  # the attempt before met it
        (note(1, repeated=True), note(1), False, True),  # a peer of this node noted it first
        (note(1, repeated=False), note(1), False, False),
        (note(0, error="DataPositionError"), note(1), False, False),
        (note(1, error="DataPositionError", repeated=True), note(1), False, False),
    ],
)  # fmt: skip
def test_merge_note(previous, current, ends_job, repeated):
    assert merge_note(previous, current, ends_job=ends_job).repeated is repeated


def test_two_launches_with_the_same_run_id_keep_separate_notes(tmp_path):
    def env(agent_dir: str, attempt: int) -> dict[str, str]:
        return {"TORCHELASTIC_ERROR_FILE": f"/tmp/{agent_dir}/none_x1/attempt_{attempt}/0/error.json"}

    a0, a3 = launch_key(env("torchelastic_aaa", 0)), launch_key(env("torchelastic_aaa", 3))
    b0 = launch_key(env("torchelastic_bbb", 0))
    assert a0 == a3 and a0 != b0 and a0
    assert launch_key({}) == "" and launch_key({"TORCHELASTIC_ERROR_FILE": "/x.json"}) == ""
    assert RepeatNotes("none", str(tmp_path), a0).path != RepeatNotes("none", str(tmp_path), b0).path


def test_the_trainer_ends_a_doomed_attempt_before_it_imports_torch(tmp_path):
    """An attempt that an earlier one's repeated error ends leaves at once (exit 1, the
    reason said), without paying torch's import: torchrun's remaining restarts cost a
    tenth of a second each, not a start-up each."""
    import json
    import os
    import subprocess
    import sys

    from elastic.repeats import NOTES_DIR

    note_dir = tmp_path / NOTES_DIR
    note_dir.mkdir()
    # written by restart 1 of run "doomed" (the launch key is empty outside an agent's dir)
    (note_dir / "doomed.json").write_text(
        json.dumps(
            {"error": "CheckpointShapeError", "point": "start-up", "message": "shapes differ",
             "restart_count": 1, "repeated": True}
        )
    )  # fmt: skip
    env = {
        **os.environ, "TMPDIR": str(tmp_path), "TORCHELASTIC_RUN_ID": "doomed",
        "TORCHELASTIC_RESTART_COUNT": "2", "RANK": "0", "WORLD_SIZE": "1",
    }  # fmt: skip
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    code = (
        "import runpy, sys\n"
        "sys.argv = ['trainer', '--config', 'examples/tiny_gpt.toml']\n"
        "try:\n"
        "    runpy.run_module('trainer', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    print('exit', exc.code, 'torch imported:', 'torch' in sys.modules)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=repo, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert "exit 1 torch imported: False" in out.stdout, out.stdout + out.stderr
    assert "restart 2 of this job ends at start-up" in out.stderr, out.stderr
