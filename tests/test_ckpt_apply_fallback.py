"""A checkpoint whose values the objects refuse (a ``load_state_dict`` raising on a value of
the wrong type) is a damaged candidate when an older checkpoint applies: quarantined at
ERROR, the resume goes on from the older one, never a crash loop. When every checkpoint is
refused the code changed, not the checkpoints: one deterministic error, nothing moved."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import ckpt
import elastic
from ckpt.errors import StateApplyError
from runcore.errors import is_deterministic
from testing.spawn import run_ok


class Counter:
    """A user's Stateful that checks what it is given."""

    def __init__(self) -> None:
        self.n = 0
        self.broken_save = False

    def state_dict(self) -> dict:
        return {"n": "abc" if self.broken_save else self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = int(state["n"])


def _train(root: str, *, break_at: int | None = None, sampler_at: int | None = None) -> None:
    model = torch.nn.Linear(2, 2)
    counter = Counter()
    sampler = elastic.ElasticSampler(16, 4, seed=0, rank=0, world_size=1)
    state = {"model": model, "counter": counter, "sampler": sampler}
    with ckpt.CheckpointManager(root, state, every=2) as manager:
        manager.resume()
        for step in range(1, 5):
            counter.n = step
            sampler.advance()
            counter.broken_save = step == break_at
            if step == sampler_at:
                good = sampler.state_dict
                sampler.state_dict = lambda good=good: {**good(), "dataset_len": "abc"}
            manager.maybe_save(step)


def _resume(root: str) -> tuple[int | None, Counter, elastic.ElasticSampler]:
    counter = Counter()
    sampler = elastic.ElasticSampler(16, 4, seed=0, rank=0, world_size=1)
    state = {"model": torch.nn.Linear(2, 2), "counter": counter, "sampler": sampler}
    with ckpt.CheckpointManager(root, state, every=2) as manager:
        return manager.resume(), counter, sampler


@pytest.mark.parametrize("where", ["counter", "sampler"])
def test_a_refused_checkpoint_is_quarantined_when_the_previous_one_applies(tmp_path, caplog, where):
    root = str(tmp_path / "root")
    _train(root, **({"break_at": 4} if where == "counter" else {"sampler_at": 4}))
    with caplog.at_level(logging.ERROR):
        step, counter, sampler = _resume(root)
    assert step == 2 and counter.n == 2 and sampler.cursor == 8
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("step 4 could not be applied" in m and repr(where) in m for m in said), said
    aside = [n for n in os.listdir(root) if ".quarantined-" in n]
    assert len(aside) == 1 and aside[0].startswith("checkpoint_0000004"), os.listdir(root)
    step, counter, _ = _resume(root)  # the next resume is clean: no crash loop
    assert step == 2 and counter.n == 2


def test_when_every_checkpoint_is_refused_it_is_one_deterministic_error_and_nothing_moves(
    tmp_path, monkeypatch
):
    root = str(tmp_path / "root")
    _train(root)
    before = sorted(os.listdir(root))

    def changed_code(self, state):  # the user's code changed: it refuses every old state
        raise KeyError("count")

    monkeypatch.setattr(Counter, "load_state_dict", changed_code)
    with pytest.raises(StateApplyError, match="could be applied") as caught:
        _resume(root)
    assert "'counter'" in str(caught.value) and is_deterministic(caught.value)
    assert sorted(os.listdir(root)) == before


def _refused_on_rank_1(rank: int, world: int, root: str, save: bool) -> dict:
    counter = Counter()
    state = {"model": torch.nn.Linear(2, 2), "counter": ckpt.PerRank(counter)}
    with ckpt.CheckpointManager(root, state, every=2) as manager:
        step = manager.resume()
        if save:
            for s in (2, 4):
                counter.n = s
                counter.broken_save = s == 4 and rank == 1
                manager.maybe_save(s)
    return {"step": step, "n": counter.n}


@pytest.mark.timeout(180)
def test_a_refusal_on_one_rank_is_agreed_by_every_rank(tmp_path):
    root = str(tmp_path / "root")
    run_ok(_refused_on_rank_1, 2, root, True)
    got = run_ok(_refused_on_rank_1, 2, root, False)
    assert [g["step"] for g in got] == [2, 2], got
    assert any(
        ".quarantined-" in n and n.startswith("checkpoint_0000004") for n in os.listdir(root)
    )
