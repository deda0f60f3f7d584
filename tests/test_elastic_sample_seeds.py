"""Per-sample seeding (elastic/sample_seeds.py): the same sample at the same position draws
the same numbers in the main process and in loader workers, and the main process's own
random streams are given back around each sample."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import elastic
from bench.loader_rng import _Ours, resumed_fraction


class Draws(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(()).item(), random.random(), np.random.normal()])


def _epoch(workers: int, persistent: bool = False) -> torch.Tensor:
    sampler = elastic.ElasticSampler(24, 4, seed=3, rank=0, world_size=1)
    loader = sampler.loader(Draws(), num_workers=workers, persistent_workers=persistent)
    it = iter(loader)
    out = []
    for _ in range(6):
        out.append(next(it))
        sampler.advance()
    return torch.cat(out)


@pytest.mark.timeout(120)
def test_draws_depend_on_the_position_only_not_on_the_worker_count():
    in_process = _epoch(0)
    assert torch.equal(_epoch(1), in_process)
    assert torch.equal(_epoch(2, persistent=True), in_process)
    assert len(set(in_process[:, 1].tolist())) == 24  # each sample its own numbers


@pytest.mark.timeout(60)
def test_the_main_process_streams_are_given_back_around_each_sample():
    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    _epoch(0)
    after = (torch.rand(()).item(), random.random(), np.random.normal())
    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    assert after == (torch.rand(()).item(), random.random(), np.random.normal())


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("before", "after"), [(2, 1), (0, 2)])
def test_a_resume_on_another_worker_count_gives_the_uninterrupted_batches(before, after):
    assert resumed_fraction(_Ours, before, after, persistent=False) == 1.0
