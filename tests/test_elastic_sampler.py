"""Epoch loops as users write them, and global batch changes on request.

``for epoch in range(sampler.epoch, E): for batch in loader:`` over
``sampler.epoch_loader()`` runs each epoch once, every sample once per epoch, resumes
mid-epoch at the right batch, and ends after E epochs; ``set_epoch`` is checked
against the cursor. Before, ``sampler.loader()`` never ended, so such a loop ran
forever with ``epoch`` stuck at 0. A resume with another global batch continues from
the same sample cursor when asked to, and is refused otherwise.
"""

from __future__ import annotations

import pytest
import torch

import ckpt
import elastic
from elastic.errors import SamplerStateError
from elastic.sampler import ElasticSampler, batch_size_suggestion, epoch_batches

pytestmark = pytest.mark.timeout(120)


def _ids(batch) -> list[int]:
    return [int(i) for i in batch]


def _epoch_loader(n: int, batch: int, rank: int = 0, world: int = 1, **kwargs):
    sampler = ElasticSampler(n, batch, seed=3, rank=rank, world_size=world)
    return sampler, sampler.epoch_loader(torch.arange(n), **kwargs)


@pytest.mark.parametrize(
    ("cursor", "n", "batch", "world", "drop_last", "expected"),
    [
        (0, 28, 8, 2, False, [(0, 8), (8, 8), (16, 8), (24, 4)]),  # a short last batch
        (0, 28, 8, 2, True, [(0, 8), (8, 8), (16, 8)]),  # dropped
        (0, 25, 8, 2, False, [(0, 8), (8, 8), (16, 8)]),  # 1 sample left < 2 ranks: dropped
        (0, 25, 8, 1, False, [(0, 8), (8, 8), (16, 8), (24, 1)]),
        (12, 28, 8, 2, False, [(12, 8), (20, 8)]),  # mid-epoch (after a batch change)
        (40, 28, 8, 2, False, [(40, 8), (48, 8)]),  # epoch 1 from 12 of 28
        (28, 28, 8, 2, False, [(28, 8), (36, 8), (44, 8), (52, 4)]),
        (0, 6, 8, 2, False, [(0, 6)]),  # a dataset smaller than the batch
        (24, 28, 16, 4, True, []),  # nothing left in the epoch
    ],
)
def test_epoch_batches_never_cross_an_epoch(cursor, n, batch, world, drop_last, expected):
    assert epoch_batches(cursor, n, batch, world, drop_last) == expected


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_each_epoch_gives_every_sample_once_and_len_is_the_batches_per_epoch(world, drop_last):
    n, batch, epochs = 30, 6 * world if world == 3 else 8, 3
    per_rank = []
    for rank in range(world):
        sampler, loader = _epoch_loader(n, batch, rank, world, drop_last=drop_last)
        seen = []
        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)
            seen.append([_ids(b) for b in loader])
        assert sampler.epoch == epochs
        per_rank.append(seen)
        expected_len = n // batch + (0 if drop_last or n % batch < world else 1)
        assert len(loader) == expected_len
        assert [len(e) for e in seen] == [expected_len] * epochs
    for epoch in range(epochs):
        ids = sorted(i for rank in range(world) for b in per_rank[rank][epoch] for i in b)
        if drop_last:
            assert len(ids) == len(set(ids)) == (n // batch) * batch
        else:
            assert ids == list(range(n)), epoch
    orders = [[i for b in per_rank[0][e] for i in b] for e in range(epochs)]
    assert orders[0] != orders[1]  # a fresh order per epoch


def test_an_interrupted_epoch_resumes_at_the_right_batch_and_the_loop_ends_after_its_epochs():
    n, batch, epochs = 28, 8, 3
    whole, loader = _epoch_loader(n, batch, num_workers=1)
    reference = [_ids(b) for epoch in range(epochs) for b in loader]
    assert len(reference) == epochs * len(loader) == 12

    first, loader = _epoch_loader(n, batch, num_workers=1)
    got = []
    for _epoch in range(first.epoch, epochs):
        for b in loader:
            got.append(_ids(b))
            if len(got) == 6:  # killed in epoch 1, after its 2nd batch (the state saved here)
                break
        if len(got) == 6:
            break
    state = first.state_dict()
    assert state["cursor"] == 28 + 16

    again, loader = _epoch_loader(n, batch, num_workers=1)
    again.load_state_dict(state)
    assert again.epoch == 1
    epochs_run = []
    for epoch in range(again.epoch, epochs):
        again.set_epoch(epoch)
        epochs_run.append(epoch)
        got.extend(_ids(b) for b in loader)
    assert epochs_run == [1, 2]
    assert got == reference
    assert again.consumed_digest == whole.consumed_digest


def test_set_epoch_is_checked_against_the_cursor():
    sampler, loader = _epoch_loader(28, 8)
    sampler.set_epoch(0)
    list(loader)
    loader.set_epoch(1)  # the loader's set_epoch is the sampler's
    with pytest.raises(SamplerStateError, match=r"range\(sampler.epoch, epochs\)"):
        sampler.set_epoch(0)  # a loop that restarted from epoch 0


def test_an_epoch_loader_moves_the_cursor_as_it_hands_out_batches():
    sampler, loader = _epoch_loader(28, 8)
    batches = iter(loader)
    first = next(batches)
    assert sampler.cursor == 8  # consumed once the body has it (after the DataLoader's prefetch)
    assert _ids(first) == sampler.global_batch_ids().tolist()  # the batch being trained on
    with pytest.raises(SamplerStateError, match="remove the advance"):
        sampler.advance()
    rest = list(batches)
    assert sampler.cursor == 28 and len(rest) == 3


def test_the_loaders_refuse_what_they_set_themselves_and_each_other():
    sampler = ElasticSampler(28, 8, rank=0, world_size=1)
    with pytest.raises(TypeError, match="batch_size"):
        sampler.epoch_loader(torch.arange(28), batch_size=4)
    sampler.epoch_loader(torch.arange(28))
    with pytest.raises(SamplerStateError, match="one loop"):
        sampler.loader(torch.arange(28))
    with pytest.raises(ValueError, match="fewer than global_batch"):
        ElasticSampler(6, 8, rank=0, world_size=1).epoch_loader(range(6), drop_last=True)


def test_the_step_loader_says_it_has_no_len_and_what_to_use():
    sampler = ElasticSampler(28, 8, rank=0, world_size=1)
    loader = sampler.loader(torch.arange(28))
    with pytest.raises(TypeError, match="epoch_loader"):
        len(loader)
    assert sampler  # truthy although len() raises


def test_a_short_last_batch_gives_each_rank_its_micro_batches():
    sampler, loader = _epoch_loader(28, 8, rank=1, world=2)
    batches = list(loader)
    assert [len(b) for b in batches] == [4, 4, 4, 2]
    micro = sampler.micro_batches(4)  # of the batch handed out last: 2 of 4 samples here
    assert [(mb.step, mb.first_position) for mb in micro] == [(0, 26)]
    assert batches[-1][micro[0].local].tolist() == sampler.local_batch_ids().tolist()


@pytest.mark.parametrize(
    ("batch", "world", "text"), [(64, 3, "63 or 66"), (2, 3, "3"), (10, 4, "8 or 12")]
)
def test_an_indivisible_global_batch_suggests_multiples_near_it(batch, world, text):
    assert batch_size_suggestion(batch, world) == text
    with pytest.raises(ValueError, match=f"e.g. {text}"):
        ElasticSampler(100, batch, rank=0, world_size=world)


def test_another_global_batch_is_refused_unless_asked_for_and_then_continues_the_cursor():
    old = ElasticSampler(100, 8, seed=1, rank=0, world_size=1)
    old.advance(3)
    state = old.state_dict()
    with pytest.raises(SamplerStateError, match="allow_batch_change=True"):
        ElasticSampler(100, 16, seed=1, rank=0, world_size=1).load_state_dict(state)

    ids = []
    for rank in range(4):  # 2 -> 4 ranks with the global batch doubled
        new = ElasticSampler(100, 16, seed=1, rank=rank, world_size=4, allow_batch_change=True)
        new.load_state_dict(state)
        assert new.batch_change == {"cursor": 24, "old_global_batch": 8, "new_global_batch": 16}
        ids.extend(new.local_batch_ids().tolist())
    assert ids == old.order.sample_ids(24, 16).tolist()  # the same samples come next

    other_order = dict(state, next_batch_digest="0" * 16)
    fresh = ElasticSampler(100, 16, seed=1, rank=0, world_size=1, allow_batch_change=True)
    with pytest.raises(SamplerStateError, match="skipped or repeated"):
        fresh.load_state_dict(other_order)


def test_a_resume_with_a_changed_batch_is_an_event_and_the_union_has_no_repeat_or_gap(tmp_path):
    root = str(tmp_path / "ckpt")
    model = torch.nn.Linear(2, 2)
    sampler = ElasticSampler(100, 8, seed=1, rank=0, world_size=1)
    consumed = []
    with ckpt.CheckpointManager(root, {"model": model, "sampler": sampler}, rng=False) as manager:
        for step in (1, 2, 3):
            consumed.extend(sampler.global_batch_ids().tolist())
            sampler.advance()
            manager.maybe_save(step, final=step == 3)

    events = []
    bigger = ElasticSampler(100, 16, seed=1, rank=0, world_size=1, allow_batch_change=True)
    state = {"model": torch.nn.Linear(2, 2), "sampler": bigger}
    record = lambda name, step, **fields: events.append((name, step, fields))  # noqa: E731
    with ckpt.CheckpointManager(root, state, rng=False, on_event=record) as manager:
        assert manager.resume() == 3
        for step in (4, 5):
            consumed.extend(bigger.global_batch_ids().tolist())
            bigger.advance()
            manager.maybe_save(step)
    changes = [(s, f) for name, s, f in events if name == "batch_change"]
    assert changes == [
        (3, {"key": "sampler", "cursor": 24, "old_global_batch": 8, "new_global_batch": 16})
    ]
    assert consumed == sampler.order.sample_ids(0, 56).tolist()  # positions 0..55, in order
    assert len(set(consumed)) == 56  # all in epoch 0: no sample twice


def test_guard_batches_number_steps_across_epochs_and_fire_a_step_fault_once():
    sampler, loader = _epoch_loader(9, 3)
    seen = []
    with elastic.RunGuard(watchdog_s=0, attempt=0, rank=0, env={}) as guard:
        for epoch in range(sampler.epoch, 2):
            for step, batch in guard.batches(loader, 0):
                seen.append((epoch, step, len(batch)))
        assert guard.last_step == 6
    assert seen == [(0, 1, 3), (0, 2, 3), (0, 3, 3), (1, 4, 3), (1, 5, 3), (1, 6, 3)]

    sampler, loader = _epoch_loader(9, 3)
    fired = []
    guard = elastic.RunGuard(faults=["raise:step=4"], watchdog_s=0, attempt=0, rank=0, env={})
    with pytest.raises(elastic.InjectedFault), guard:
        for _epoch in range(sampler.epoch, 2):
            for step, _batch in guard.batches(loader, 0):
                fired.append(step)
    assert fired == [1, 2, 3]  # step 4's fault fired at its start, before its batch was fetched
    assert sampler.cursor == 9  # ... so the next epoch's first batch was not consumed


def test_a_sampler_built_before_the_process_group_is_bound_to_its_rank_later():
    """Built as rank 0 of 1 (no process group yet, as inside a framework's fit), then bound:
    each rank gets its own slice of the global batch, the cursor untouched; a world size the
    global batch does not divide is refused as at construction."""
    early = ElasticSampler(40, 8, seed=3)
    assert (early.rank, early.world_size) == (0, 1)
    early.cursor = 16
    early.bind(1, 2)
    built = ElasticSampler(40, 8, seed=3, rank=1, world_size=2)
    built.cursor = 16
    assert early.cursor == 16 and early.local_batch == 4
    assert early.local_batch_ids().tolist() == built.local_batch_ids().tolist()
    whole = ElasticSampler(40, 8, seed=3).global_batch_ids(16).tolist()
    assert early.local_batch_ids().tolist() == whole[4:8]  # rank 1's half, not the whole batch
    with pytest.raises(ValueError, match="global_batch=8 is not divisible by world_size=3"):
        early.bind(0, 3)
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, world_size=2\)"):
        early.bind(2, 2)
    assert (early.rank, early.world_size) == (1, 2)
