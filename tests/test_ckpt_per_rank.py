"""Per-rank state is kept per rank: BatchNorm statistics, plain dicts of tensors, PerRank.

Before, DCP saved a plain (non-DTensor) tensor once, as if every rank held the same
copy: after a restart rank 0's BatchNorm running statistics came back as rank 1's,
silently. Real processes on gloo (``testing.spawn``), an FSDP2 CNN with BatchNorm and
dropout, every rank fed its own data.
"""

from __future__ import annotations

import logging

import pytest
import torch

import ckpt
from ckpt.state import per_rank
from testing.spawn import run_ok

pytestmark = pytest.mark.timeout(300)


def _cnn(seed: int):
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.3),
        nn.Flatten(), nn.Linear(4 * 6 * 6, 3),
    )  # fmt: skip
    fully_shard(model[0])
    fully_shard(model[5])
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, optim, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(5, 1, 6, 6, generator=gen) * (1 + rank)  # ranks see different data
    model.train()
    model(x).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def _local_state(model, optim) -> dict[str, torch.Tensor]:
    """Every tensor this rank holds: local shards of parameters, buffers, optimizer state."""
    out = {}
    for name, t in model.state_dict().items():
        out[f"model.{name}"] = (t.to_local() if hasattr(t, "to_local") else t).clone()
    for pid, (param, state) in enumerate(optim.state.items()):
        del param
        for key, value in state.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            out[f"optim.{pid}.{key}"] = local.clone()
    return out


def _state(model, optim, rank: int, extras: dict) -> dict:
    return {"model": model, "optim": optim, **extras}


def _extras(rank: int) -> dict:
    return {
        "stats": {"seen": torch.tensor([10.0 * rank + 1]), "shared": torch.ones(3)},
        "local": ckpt.PerRank({"x": torch.zeros(2)}),  # equal now, per rank by declaration
    }


def _train_save_continue(rank: int, world: int, root: str) -> dict:
    model, optim = _cnn(seed=0)
    extras = _extras(rank)
    manager = ckpt.CheckpointManager(root, _state(model, optim, rank, extras))
    for step in (1, 2, 3):
        _train_step(model, optim, rank, step)
    manager.save(3)
    saved = _local_state(model, optim)
    for step in (4, 5):
        _train_step(model, optim, rank, step)
    manager.close()
    return {"saved": saved, "after": _local_state(model, optim)}


def _resume_continue(rank: int, world: int, root: str) -> dict:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ckpt.manager").addHandler(handler)
    model, optim = _cnn(seed=123)  # a restarted process builds other values first
    extras = _extras(rank)
    extras["stats"]["seen"].fill_(-5.0)
    manager = ckpt.CheckpointManager(root, _state(model, optim, rank, extras))
    torch.manual_seed(777)  # and its RNG is elsewhere
    assert manager.resume() == 3
    loaded = _local_state(model, optim)
    seen = float(extras["stats"]["seen"])
    for step in (4, 5):
        _train_step(model, optim, rank, step)
    manager.close()
    return {"loaded": loaded, "after": _local_state(model, optim), "seen": seen, "log": records}


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key}"


def test_each_rank_resumes_its_own_batchnorm_stats_and_continues_bitwise(tmp_path):
    root = str(tmp_path / "ckpt")
    first = run_ok(_train_save_continue, 2, root)
    mean = "model.1.running_mean"
    assert not torch.equal(first[0]["saved"][mean], first[1]["saved"][mean])  # per rank by nature

    record = ckpt.find_latest_committed(root).manifest.metadata["ckpt_manager"]
    assert "model/1.running_mean" in record["per_rank"]
    assert "model/1.running_var" in record["per_rank"]
    assert "stats/seen" in record["per_rank"] and "local/x" in record["per_rank"]
    assert "stats/shared" not in record["per_rank"]  # equal everywhere: saved once

    again = run_ok(_resume_continue, 2, root)
    for rank in (0, 1):
        _assert_equal(again[rank]["loaded"], first[rank]["saved"], f"rank {rank} loaded")
        _assert_equal(again[rank]["after"], first[rank]["after"], f"rank {rank} continued")
        assert again[rank]["seen"] == 10.0 * rank + 1

    # 2 -> 1 ranks: the documented rule (new rank r takes saved rank r % 2), said aloud.
    [alone] = run_ok(_resume_continue, 1, root)
    assert torch.equal(alone["loaded"][mean], first[0]["saved"][mean])
    assert alone["seen"] == 1.0
    [warning] = [m for m in alone["log"] if "per-rank state" in m]
    assert "model/1.running_mean" in warning and "r % 2" in warning


def test_move_out_and_back_never_change_the_callers_dicts():
    user = {"w": torch.ones(2), "n": 3}
    state = {"plain": user, "model": {"a": torch.zeros(1)}}
    per_rank.move_out(state, ["plain/w"], rank=1)
    assert "w" in user and "w" not in state["plain"]
    assert state["per_rank"]["rank_1"]["plain/w"] is user["w"]
    per_rank.move_back(state, ["plain/w"], rank=1)
    assert state["plain"]["w"] is user["w"] and "per_rank" not in state


def test_differing_digests_find_only_what_differs():
    a = per_rank.digests({"x": torch.ones(2), "y": torch.zeros(2)})
    b = per_rank.digests({"x": torch.ones(2), "y": torch.ones(2)})
    assert per_rank.differing([a, b]) == {"y"}
    assert per_rank.differing([a, {"x": a["x"]}]) == {"y"}  # missing on a rank: per rank
    assert per_rank.source_rank(3, 4, 4) == 3 and per_rank.source_rank(3, 2, 4) == 1
