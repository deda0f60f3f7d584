"""End-to-end on s3://: ``python -m trainer`` under torchrun (2 ranks) checkpoints to the
moto S3 server, a worker is SIGKILLed, the group restarts and resumes from s3://, and
every loss equals, bit for bit, an uninterrupted run's on a local disk.
"""

from __future__ import annotations

import json
import os

import pytest
from test_retention_e2e import losses, train

import ckpt
from ckpt.storage import Storage

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STEPS = ["--max-steps", "30", "--ckpt-every", "10"]


def test_a_rank_killed_mid_run_resumes_from_s3_and_matches_an_uninterrupted_run(s3_root, tmp_path):
    train(str(tmp_path / "ref" / "ckpt"), str(tmp_path / "ref" / "run"), *STEPS)
    run_dir = str(tmp_path / "run")
    train(s3_root, run_dir, *STEPS, "--fault", "kill:step=15:rank=1", max_restarts=1)

    reference, got = losses(str(tmp_path / "ref" / "run")), losses(run_dir)
    assert sorted(got) == list(range(1, 31))
    assert all(got[step] == reference[step] for step in got), (got, reference)
    with open(os.path.join(run_dir, "events.jsonl")) as fh:
        events = [json.loads(line) for line in fh if line.strip()]
    assert [e["step"] for e in events if e["event"] == "resume"] == [10]
    assert [i.step for i in ckpt.list_checkpoints(s3_root) if i.committed] == [30, 20, 10]
    latest = ckpt.find_latest_committed(s3_root)
    report = ckpt.verify_dir(
        Storage(s3_root).child(latest.dirname), latest.manifest, mode="checksum"
    )
    assert report.ok and report.crc_checked == len(latest.manifest.files)  # S3's CRC32C
    assert report.bytes_checked == 0
