"""Non-finite values never become a checkpoint: found while the bytes are checksummed.

A diverged run trained on NaN to the end and exited 0, its kept checkpoints all NaN and
retention having deleted the last finite ones. Now a save looks at every floating tensor
as it streams out (no second pass over memory for the large ones) and does not commit a
NaN or an infinity, on every backend, sync or async, durable or memory tier, naming the
tensors and the ranks; ``allow_non_finite`` exempts keys that hold them on purpose, and
``python -m ckpt verify --finite`` finds them in a checkpoint from elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch

import ckpt
from ckpt import cli
from ckpt.root.catalog import list_checkpoints
from ckpt.saving import finite
from ckpt.saving.writer import SMALL_ITEM_BYTES
from testing.spawn import run_ok

pytestmark = pytest.mark.timeout(300)

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64]
)
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_is_finite_finds_a_single_bad_value_anywhere_in_every_floating_dtype(dtype, bad):
    n = 3 * finite.PIECE_BYTES // torch.empty(0, dtype=dtype).element_size() + 7
    for where in (0, n // 2, n - 1):  # first piece, a middle piece, the short last one
        t = torch.ones(n, dtype=dtype)
        assert finite.is_finite(t)
        t[where] = complex(bad, 0) if dtype.is_complex else bad
        assert not finite.is_finite(t), (dtype, bad, where)


def test_finite_values_whose_sum_overflows_are_finite():
    # float32 sums of huge values overflow to inf: the check must not call that non-finite
    t = torch.full((1 << 20,), 3e38, dtype=torch.float32)
    assert math.isinf(t.sum().item())
    assert finite.is_finite(t)
    t[-1] = -INF
    assert not finite.is_finite(t)


def test_integer_and_empty_tensors_are_never_scanned():
    assert not finite.scannable(torch.zeros(4, dtype=torch.int64))
    assert not finite.scannable(torch.zeros(0))
    assert finite.is_finite(torch.zeros(0))


def _state(n: int = 3 << 20) -> dict:
    return {
        "w": torch.randn(n),  # 12 MB: written, checksummed and scanned piece by piece
        "b": torch.ones(3),
        "h": torch.ones(1000, dtype=torch.bfloat16),
        "n": torch.arange(10),
        "step": 1,
    }


def test_a_save_holding_nan_is_not_committed_and_names_the_tensor(any_root):
    state = _state()
    ckpt.save(state, any_root, 1)
    state["w"][2_000_001] = NAN
    state["h"][7] = -INF
    with pytest.raises(ckpt.NonFiniteStateError) as err:
        ckpt.save(state, any_root, 2)
    assert err.value.keys == {"w": [0], "h": [0]}
    assert "w (rank 0)" in str(err.value) and "h (rank 0)" in str(err.value)
    assert "step 2 was not committed" in str(err.value)
    # nothing of it is left: the newest committed checkpoint is the finite one
    assert [(i.step, i.status) for i in list_checkpoints(any_root)] == [(1, "committed")]
    loaded = {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in _state().items()
    }
    assert ckpt.load(loaded, any_root).step == 1
    assert finite.is_finite(loaded["w"])


def test_the_large_tensor_is_scanned_as_it_is_checksummed_not_in_a_second_pass(
    tmp_root, monkeypatch
):
    looked: list[tuple[int, int]] = []
    real_look = finite.ValueWatch.look
    monkeypatch.setattr(
        finite.ValueWatch, "look", lambda self, o, n: looked.append((o, n)) or real_look(self, o, n)
    )
    whole_passes: list[int] = []
    real_is_finite = finite.is_finite
    monkeypatch.setattr(
        finite, "is_finite", lambda t: whole_passes.append(t.numel()) or real_is_finite(t)
    )
    state = _state()
    ckpt.save(state, tmp_root, 1)
    # every byte of w (two row blocks: 8 MiB and 4 MiB) looked at once, a piece at a time
    assert sum(n for _, n in looked) == state["w"].numel() * 4
    assert {n for _, n in looked} == {finite.PIECE_BYTES}
    # no large tensor is read again after it was written: only the small ones, serialized
    # in memory, are checked whole (at once, still in the cache)
    small = {v.numel() for v in state.values() if isinstance(v, torch.Tensor)}
    small = {n for n in small if n * 4 <= SMALL_ITEM_BYTES}
    assert whole_passes and set(whole_passes) <= small, (whole_passes, small)
    state["w"][-1] = INF
    with pytest.raises(ckpt.NonFiniteStateError):
        ckpt.save(state, tmp_root, 2)


def test_allow_non_finite_exempts_the_keys_it_names_and_only_those(tmp_root):
    state = _state(1000)
    state["h"][0] = -INF  # a -inf mask, on purpose
    assert ckpt.save(state, tmp_root, 1, allow_non_finite=["h"])
    state["w"][3] = NAN
    with pytest.raises(ckpt.NonFiniteStateError) as err:
        ckpt.save(state, tmp_root, 2, allow_non_finite=["h"])
    assert set(err.value.keys) == {"w"}
    assert ckpt.save(state, tmp_root, 3, allow_non_finite=True)
    with pytest.raises(ValueError, match="allow_non_finite"):
        ckpt.save(state, tmp_root, 4, allow_non_finite="h")


def test_verify_finite_names_the_non_finite_tensors_of_a_checkpoint(tmp_root, capsys):
    state = _state(1000)
    ckpt.save(state, tmp_root, 1)
    state["w"][:5] = NAN
    state["w"][5] = INF
    ckpt.save(state, tmp_root, 2, allow_non_finite=True)
    assert cli.main(["verify", tmp_root, "--step", "1", "--finite"]) == 0
    assert "every floating tensor finite" in capsys.readouterr().out
    assert cli.main(["verify", tmp_root, "--step", "2"]) == 0  # bytes intact: no --finite, OK
    capsys.readouterr()
    assert cli.main(["verify", tmp_root, "--step", "2", "--finite"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "w: 5 NaN and 1 infinite values" in out


def test_an_async_save_holding_nan_fails_at_wait(tmp_root):
    state = _state(1000)
    state["b"][1] = NAN
    pending = ckpt.save(state, tmp_root, 1, async_save=True)
    with pytest.raises(ckpt.NonFiniteStateError):
        pending.wait()
    ckpt.close()
    assert list_checkpoints(tmp_root) == []


def test_a_save_to_gcs_holding_nan_is_not_committed(gcs_root):
    state = _state()
    state["w"][-3] = NAN
    with pytest.raises(ckpt.NonFiniteStateError):
        ckpt.save(state, gcs_root, 1)
    assert list_checkpoints(gcs_root) == []
    state["w"][-3] = 0.0
    assert ckpt.save(state, gcs_root, 1)


def _nan_on_rank_one(rank: int, world: int, root: str) -> str:
    # a key of each rank's own (a key on every rank is written once, by rank 0: DCP dedup)
    state = {f"mine{rank}": torch.full((4,), float(rank)), "v": torch.ones(2)}
    ckpt.save(state, root, 1)
    if rank == 1:
        state["mine1"][0] = NAN
    try:
        ckpt.save(state, root, 2)
    except ckpt.NonFiniteStateError as exc:
        return f"{type(exc).__name__}: {exc.keys}"
    return "committed"


def test_a_nan_on_one_rank_fails_the_save_on_every_rank_naming_that_rank(tmp_root):
    results = run_ok(_nan_on_rank_one, 2, tmp_root)
    assert results == ["NonFiniteStateError: {'mine1': [1]}"] * 2
    assert [i.step for i in list_checkpoints(tmp_root)] == [1]


def test_a_manager_counts_a_non_finite_save_as_a_failed_save_and_keeps_the_finite_one(
    tmp_root, tmp_path
):
    model = torch.nn.Linear(4, 2)
    events: list[tuple[str, int, dict]] = []
    manager = ckpt.CheckpointManager(
        tmp_root,
        {"model": model},
        every=1,
        retention=ckpt.RetentionPolicy(keep_last=1),
        memory_every=1,
        memory_dir=str(tmp_path / "mem"),
        on_event=lambda name, step, **f: events.append((name, step, f)),
    )
    with manager:
        assert manager.resume() is None
        assert manager.maybe_save(1)
        assert manager.inject_non_finite() == ["model.weight", "model.bias"]
        assert manager.maybe_save(2) is None
        assert manager.maybe_save(3) is None
        with pytest.raises(ckpt.TooManySaveFailuresError):
            manager.maybe_save(4)
    failed = [(s, f["non_finite"]) for n, s, f in events if n == "checkpoint_failed"]
    assert failed == [(s, ["model.bias", "model.weight"]) for s in (2, 3, 4)]
    snapshots = [(n, s) for n, s, _ in events if n == "memory_snapshot_failed"]
    assert snapshots == [("memory_snapshot_failed", s) for s in (2, 3, 4)]
    # retention (keep_last=1) kept the newest finite checkpoint: nothing newer committed
    assert [(i.step, i.status) for i in list_checkpoints(tmp_root)] == [(1, "committed")]
    resumed = torch.nn.Linear(4, 2)
    with ckpt.CheckpointManager(tmp_root, {"model": resumed}) as again:
        assert again.resume() == 1
    assert finite.is_finite(resumed.weight.detach())
