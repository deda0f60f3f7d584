"""A URL's password or signed query never reaches a log line, an event, the CLI's output
or an error message; control characters from a root are escaped in log lines
(runcore/redact.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import ckpt
from ckpt.cli import main as cli_main
from ckpt.errors import CheckpointDirError
from elastic.events import RunRecorder
from runcore.redact import redact, safe_text

SECRET = "hunter2"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sftp://alice:hunter2@host/x", "sftp://alice:***@host/x"),
        ("under s3://k:hunter2@bucket/ckpt now", "under s3://k:***@bucket/ckpt now"),
        ("https://h/x?X-Amz-Signature=hunter2&n=1", "https://h/x?X-Amz-Signature=***&n=1"),
        ("gs://b/x?access_token=hunter2", "gs://b/x?access_token=***"),
        # nothing secret: unchanged
        ("http://host:8080/path@v2", "http://host:8080/path@v2"),
        ("s3://bucket/a:b@c", "s3://bucket/a:b@c"),
        ("ssh://alice@host/x", "ssh://alice@host/x"),
        ("/tmp/ckpt?step=3", "/tmp/ckpt?step=3"),
    ],
)
def test_redact(text, expected):
    assert redact(text) == expected


def test_safe_text_escapes_terminal_sequences_but_keeps_lines():
    assert safe_text("a\x1b[2Jb\rc\nd\te\u202e") == "a\\x1b[2Jb\\rc\nd\te\\u202e"


def test_log_records_of_the_project_are_cleaned_whatever_the_handler(caplog):
    with caplog.at_level(logging.INFO):
        logging.getLogger("ckpt.root.quarantine").warning(
            "root %s: %s", "s3://k:hunter2@b/r", "reason \x1b]0;pwned\x07"
        )
        logging.getLogger("elastic.guard").info(f"f-string s3://k:{SECRET}@b/r")
        logging.getLogger("someone.else").warning("s3://k:hunter2@b/r")  # not ours: untouched
    ours = [r.getMessage() for r in caplog.records if not r.name.startswith("someone")]
    assert ours == ["root s3://k:***@b/r: reason \\x1b]0;pwned\\x07", "f-string s3://k:***@b/r"]
    assert caplog.records[-1].getMessage() == "s3://k:hunter2@b/r"


@pytest.mark.timeout(60)
def test_a_root_with_a_password_is_never_logged_nor_in_an_event(tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)  # fsspec reads file://user:pw@host/... as a relative path
    root = f"file://alice:{SECRET}@localhost{tmp_path}/r"
    events = []
    with caplog.at_level(logging.INFO):
        manager = ckpt.CheckpointManager(
            root,
            {"m": torch.nn.Linear(2, 2)},
            every=1,
            on_event=lambda name, step, **f: events.append({"name": name, "step": step, **f}),
        )
        manager.resume()
        manager.maybe_save(1)
        manager.close()
    said = [r.getMessage() for r in caplog.records]
    assert any("alice:***@localhost" in m for m in said), said
    assert not [m for m in said if SECRET in m]
    assert any(e["name"] == "checkpoint_saved" for e in events), events
    assert SECRET not in json.dumps(events, default=str)


def test_the_cli_and_errors_never_show_the_password(tmp_path, capsys):
    code = cli_main(["ls", f"file://alice:{SECRET}@localhost/nowhere/at/all"])
    out = capsys.readouterr()
    assert code != 0 and "alice:***@localhost" in out.err, out
    assert SECRET not in out.out + out.err
    assert SECRET not in str(CheckpointDirError(f"bad root s3://k:{SECRET}@b/r"))


def test_the_run_log_redacts_its_events(tmp_path):
    with RunRecorder(str(tmp_path), rank=0) as recorder:
        recorder.event("checkpoint_fallback", 3, url=f"s3://k:{SECRET}@b/r/x", path="p",
                       reason="r")  # fmt: skip
    text = (tmp_path / "events.jsonl").read_text()
    assert "s3://k:***@b/r/x" in text and SECRET not in text
