"""elastic.sample_rng: dropout keyed by the global micro-batch, never by the rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import elastic
from ckpt.state.rng import derive_seed as ckpt_derive_seed
from elastic.rng import (
    DROPOUT_STREAM,
    MicroBatchSplitError,
    micro_batch_seed,
    plan_micro_batches,
    sample_rng,
)

pytestmark = pytest.mark.timeout(60)

GLOBAL_BATCH = 12
MICRO = 2


def global_dropout_mask(world_size: int, step: int, *, rank_noise: bool) -> torch.Tensor:
    """The dropout mask of every sample of one global batch, computed as ``world_size`` ranks.

    Each "rank" runs with its own process RNG state (``rank_noise``), as real ranks do
    after a resume on another world size.
    """
    drop = nn.Dropout(0.5)
    x = torch.ones(GLOBAL_BATCH // world_size, 8)
    rows = []
    for rank in range(world_size):
        if rank_noise:
            torch.manual_seed(1000 * world_size + rank)
        sampler = elastic.ElasticSampler(48, GLOBAL_BATCH, seed=3, rank=rank, world_size=world_size)
        sampler.advance(step - 1)
        for mb in sampler.micro_batches(MICRO):
            with mb.rng(seed=5):
                rows.append(drop(x[mb.local]) != 0)
    return torch.cat(rows)


def test_same_global_micro_batch_gets_the_same_mask_on_any_rank_and_world_size():
    masks = {w: global_dropout_mask(w, step=4, rank_noise=True) for w in (1, 2, 3, 6)}
    assert masks[1].shape == (GLOBAL_BATCH, 8)
    assert 0.2 < masks[1].float().mean() < 0.8  # a real mask, not all kept or all dropped
    for world_size in (2, 3, 6):
        assert torch.equal(masks[world_size], masks[1]), world_size
    # Another step draws other masks; micro-batches of one step differ from each other.
    assert not torch.equal(global_dropout_mask(1, step=5, rank_noise=False), masks[1])
    assert not torch.equal(masks[1][:MICRO], masks[1][MICRO : 2 * MICRO])


def test_without_the_scope_the_masks_follow_the_rank_stream():
    """The gap the helper closes: the process RNG of another world size draws other masks."""
    drop = nn.Dropout(0.5)
    x = torch.ones(GLOBAL_BATCH, 8)
    torch.manual_seed(1000)
    alone = drop(x) != 0
    halves = []
    for rank in range(2):
        torch.manual_seed(2000 + rank)
        halves.append(drop(x[: GLOBAL_BATCH // 2]) != 0)
    assert not torch.equal(torch.cat(halves), alone)


def test_the_callers_rng_state_is_restored_on_exit_and_on_error():
    torch.manual_seed(42)
    before = torch.get_rng_state()
    expected_next = torch.rand(4)
    torch.set_rng_state(before)
    with sample_rng(1, 2, 3):
        inside = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(torch.rand(4), expected_next)
    assert not torch.equal(inside, expected_next)

    torch.set_rng_state(before)
    with pytest.raises(RuntimeError, match="boom"), sample_rng(1, 2, 3):
        torch.rand(100)
        raise RuntimeError("boom")
    assert torch.equal(torch.get_rng_state(), before)


def test_the_scope_leaves_user_generators_alone():
    gen = torch.Generator().manual_seed(9)
    state = gen.get_state()
    with sample_rng(1, 2, 3):
        torch.rand(4)
    assert torch.equal(gen.get_state(), state)


def test_the_key_is_the_trainers_per_micro_batch_seed():
    # The built-in trainer seeded dropout with torch.manual_seed(derive_seed(seed, step, j,
    # 0xD0)) before this helper existed; keeping that key keeps its runs reproducible.
    assert DROPOUT_STREAM == 0xD0
    for seed, step, index in ((0, 1, 0), (7, 3, 5), (123, 40, 11)):
        value = micro_batch_seed(seed, step, index)
        assert value == ckpt_derive_seed(seed, step, index, 0xD0)
        reference = torch.rand(6, generator=torch.Generator().manual_seed(value))
        with sample_rng(seed, step, index) as yielded:
            assert yielded == value
            assert torch.equal(torch.rand(6), reference)
    assert micro_batch_seed(0, 1, 0) != micro_batch_seed(0, 1, 1) != micro_batch_seed(0, 2, 1)


@pytest.mark.parametrize(
    ("cursor", "world_size", "rank", "micro", "expected"),
    [
        # (step, global index, first position, local rows) of each micro-batch
        (0, 1, 0, 4, [(1, 0, 0, (0, 4)), (1, 1, 4, (4, 8)), (1, 2, 8, (8, 12))]),
        (0, 2, 1, 2, [(1, 3, 6, (0, 2)), (1, 4, 8, (2, 4)), (1, 5, 10, (4, 6))]),
        (24, 3, 2, 2, [(3, 4, 32, (0, 2)), (3, 5, 34, (2, 4))]),
        (36, 6, 5, 2, [(4, 5, 46, (0, 2))]),
        (12, 4, 0, 3, [(2, 0, 12, (0, 3))]),
    ],
)
def test_plan_places_each_micro_batch_in_the_global_batch(
    cursor, world_size, rank, micro, expected
):
    plan = plan_micro_batches(cursor, GLOBAL_BATCH, world_size, rank, micro)
    got = [(m.step, m.index, m.first_position, (m.local.start, m.local.stop)) for m in plan]
    assert got == expected


def test_plan_matches_the_trainers_micro_batch_index():
    # trainer/loop.py keys micro-batch k of rank r with r * accum + k, step = steps done + 1.
    for world_size in (1, 2, 3, 6):
        accum = GLOBAL_BATCH // (world_size * MICRO)
        for rank in range(world_size):
            plan = plan_micro_batches(2 * GLOBAL_BATCH, GLOBAL_BATCH, world_size, rank, MICRO)
            assert [(m.step, m.index) for m in plan] == [
                (3, rank * accum + k) for k in range(accum)
            ]


@pytest.mark.parametrize(
    ("world_size", "micro", "match"),
    [
        (2, 4, r"per-rank batch global_batch/world_size = 12/2 = 6 is not a multiple of "
               r"micro_batch=4"),
        (3, 3, r"12/3 = 4 is not a multiple of micro_batch=3"),
        (2, 0, r"micro_batch must be >= 1, got 0"),
        (5, 1, r"global_batch=12 is not divisible by world_size=5"),
    ],
)  # fmt: skip
def test_an_invalid_micro_batch_split_is_an_error_that_says_what_to_do(world_size, micro, match):
    with pytest.raises(MicroBatchSplitError, match=match) as info:
        plan_micro_batches(0, GLOBAL_BATCH, world_size, 0, micro)
    assert isinstance(info.value, ValueError)
    if micro > 1 and GLOBAL_BATCH % world_size == 0:
        assert "keep one micro-batch size on every world size" in str(info.value)


def test_the_sampler_raises_the_split_error_for_its_own_batch():
    sampler = elastic.ElasticSampler(48, GLOBAL_BATCH, seed=0, rank=0, world_size=2)
    with pytest.raises(elastic.MicroBatchSplitError, match="micro_batch=5"):
        sampler.micro_batches(5)
    assert len(sampler.micro_batches(3)) == 2


def test_a_negative_micro_index_is_refused():
    with pytest.raises(ValueError, match="micro_index must be >= 0, got -1"):
        micro_batch_seed(0, 1, -1)
