"""The data position is guarded and auditable: a forgotten ``advance()`` is an error, and
every checkpoint records the cursor with digests of the sample stream.

Before, a script that forgot ``sampler.advance()`` trained fine and, after a restart,
silently replayed the data from the start (step 13 after resume = step 1).
"""

from __future__ import annotations

import pytest
import torch

import ckpt
import ckpt.errors
import elastic

pytestmark = pytest.mark.timeout(60)


def _manager(root: str, sampler: elastic.ElasticSampler, **kwargs) -> ckpt.CheckpointManager:
    model = torch.nn.Linear(4, 2)
    return ckpt.CheckpointManager(root, {"model": model, "sampler": sampler}, rng=False, **kwargs)


def test_a_save_after_steps_without_advance_names_advance(tmp_path):
    sampler = elastic.ElasticSampler(100, 8, seed=1, rank=0, world_size=1)
    with _manager(str(tmp_path / "ckpt"), sampler, every=2) as manager:
        assert manager.resume() is None
        with pytest.raises(ckpt.errors.DataPositionError, match=r"sampler\.advance\(\)") as err:
            for step in (1, 2):
                manager.maybe_save(step)  # the loop forgot sampler.advance()
        assert "cursor stayed at 0" in str(err.value)
    assert ckpt.find_latest_committed(str(tmp_path / "ckpt")) is None  # nothing saved


def test_advancing_saves_and_records_the_position_and_a_resume_checks_it(tmp_path):
    root = str(tmp_path / "ckpt")
    sampler = elastic.ElasticSampler(100, 8, seed=1, rank=0, world_size=1)
    with _manager(root, sampler, every=2) as manager:
        manager.resume()
        for step in range(1, 5):
            sampler.advance()
            manager.maybe_save(step)
        # Saving the same step again (an emergency save after a periodic one) is fine.
        manager.save(4)
    record = ckpt.find_latest_committed(root).manifest.metadata["ckpt_manager"]
    position = record["data_position"]["sampler"]
    assert position["cursor"] == 32
    assert position["consumed_digest"] == sampler.consumed_digest != ""

    # A resume restores the running digest and continues the stream from there.
    again = elastic.ElasticSampler(100, 8, seed=1, rank=0, world_size=1)
    with _manager(root, again, every=2) as manager:
        assert manager.resume() == 4
        assert (again.cursor, again.consumed_digest) == (32, sampler.consumed_digest)
        with pytest.raises(ckpt.errors.DataPositionError):
            manager.maybe_save(6)  # steps 5, 6 without advance() after a resume


def test_the_stream_digest_is_the_same_on_every_world_size():
    digests = set()
    for world in (1, 2, 3, 4):
        per_rank = []
        for rank in range(world):
            sampler = elastic.ElasticSampler(50, 12, seed=7, rank=rank, world_size=world)
            sampler.advance(5)  # crosses an epoch boundary (60 > 50 samples)
            per_rank.append(sampler.data_position())
        assert all(p == per_rank[0] for p in per_rank)
        digests.add((per_rank[0]["consumed_digest"], per_rank[0]["next_batch_digest"]))
    assert len(digests) == 1


def test_a_stream_that_would_not_continue_where_the_checkpoint_says_is_refused():
    sampler = elastic.ElasticSampler(100, 8, seed=1, rank=0, world_size=1)
    sampler.advance(3)
    state = sampler.state_dict()
    state["next_batch_digest"] = "0" * 16  # another order at that cursor (another dataset order)
    fresh = elastic.ElasticSampler(100, 8, seed=1, rank=0, world_size=1)
    with pytest.raises(ValueError, match="skipped or repeated"):
        fresh.load_state_dict(state)
    fresh.load_state_dict(sampler.state_dict())
    assert fresh.cursor == 24 and fresh.consumed_digest == sampler.consumed_digest


def test_ckpt_inspect_shows_the_data_position(tmp_path, capsys):
    from ckpt import cli

    root = str(tmp_path / "ckpt")
    sampler = elastic.ElasticSampler(100, 8, seed=1, rank=0, world_size=1)
    with _manager(root, sampler) as manager:
        sampler.advance(2)
        manager.save(2)
    assert cli.main(["inspect", root]) == 0
    out = capsys.readouterr().out
    line = next(li for li in out.splitlines() if li.startswith("data "))
    assert "sampler: cursor 16" in line and sampler.consumed_digest in line
