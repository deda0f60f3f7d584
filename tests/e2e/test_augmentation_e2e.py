"""End-to-end: augmentation drawn in DataLoader workers resumes exactly.

A user's vision-style Dataset draws a random crop (``torch.randint``), a flip
(``random``) and noise (``numpy``, ``torch.rand``) in ``__getitem__``, served by 2 worker
processes. The run is killed after step 14 (its newest checkpoint is step 12) and
resumed with 1 worker (not persistent, or none): every batch and loss equals the
uninterrupted run's, step for step. Before, the workers' streams restarted from seeds
that depend on the worker and the resume point, and 18 of 30 steps differed. A user's own
DataLoader without ``sampler.seeded`` is said at WARNING at the first save.

Real processes (``tests/e2e/scripts/augmented_loader.py``), bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testing.local_cluster import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SCRIPT = os.path.join(REPO, "tests", "e2e", "scripts", "augmented_loader.py")


def run(root, out, mode: str, workers: int, persistent: bool, stop: int) -> str:
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, SCRIPT, str(root), str(out), mode, str(workers), str(int(persistent)),
         str(stop)],
        env=env, capture_output=True, text=True, timeout=150, check=False,
    )  # fmt: skip
    assert proc.returncode == (1 if stop else 0), proc.stderr[-3000:]
    return proc.stderr


def rows(path) -> dict[int, list]:
    out: dict[int, list] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            out[row[0]] = row  # a step re-run after the resume replaces the killed run's
    return out


@pytest.mark.parametrize(
    ("mode", "workers", "persistent", "resumed_workers"),
    [("epochs", 2, True, 1), ("user", 2, False, 0)],
)
def test_a_killed_run_resumes_with_the_same_augmented_batches(
    tmp_path, mode, workers, persistent, resumed_workers
):
    run(tmp_path / "a", tmp_path / "a.jsonl", mode, workers, persistent, 0)
    run(tmp_path / "b", tmp_path / "b.jsonl", mode, workers, persistent, 14)
    run(tmp_path / "b", tmp_path / "b.jsonl", mode, resumed_workers, False, 0)
    uninterrupted, resumed = rows(tmp_path / "a.jsonl"), rows(tmp_path / "b.jsonl")
    assert len(uninterrupted) >= 20
    assert resumed == uninterrupted


def test_a_users_loader_with_workers_and_no_hook_is_said_at_the_first_save(tmp_path):
    said = run(tmp_path / "c", tmp_path / "c.jsonl", "plain", 2, False, 5)
    assert "a DataLoader with 2 worker(s) takes its indices from this ElasticSampler" in said
    assert "sampler.seeded(dataset)" in said
    quiet = run(tmp_path / "d", tmp_path / "d.jsonl", "user", 2, False, 5)
    assert "cannot replay" not in quiet


def test_a_dataset_with_a_batched_getitems_is_still_seeded_per_sample():
    import torch
    from torch.utils.data import DataLoader

    import elastic

    class Batched:
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.rand(())

        def __getitems__(self, keys):  # what DataLoader's fetcher prefers when present
            return [torch.rand(()) for _ in keys]

    def draws(workers: int) -> list[float]:
        sampler = elastic.ElasticSampler(8, global_batch=4, seed=3, rank=0, world_size=1)
        loader = DataLoader(sampler.seeded(Batched()), sampler=sampler, batch_size=4,
                            num_workers=workers)  # fmt: skip
        it = iter(loader)
        return [float(x) for _ in range(2) for x in next(it)]

    assert draws(0) == draws(2)  # the same numbers, served by the main process or workers
