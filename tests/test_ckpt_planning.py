"""The save collective (ckpt.saving.planning) on real gloo ranks: a save of a layout the
ranks already planned exchanges no plans, and what it writes is what stock DCP reads."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import ckpt
from ckpt.format.layout import checkpoint_dirname
from testing.spawn import run_ok

pytestmark = pytest.mark.timeout(300)

LAYERS = 20


def _state(world: int, rank: int, *, extra: bool = False) -> dict:
    """DTensors sharded over the ranks (uneven rows), a plain replicated tensor and a
    Python value: the kinds of items a save plans."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = {}
    for i in range(LAYERS):
        full = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3) + i
        model[f"w{i}"] = distribute_tensor(full, mesh, [Shard(0)])
    model["scale"] = torch.tensor(2.0)
    state = {"model": model, "meta": {"name": "run", "epoch": 1}}
    if extra:
        state["model"]["added"] = torch.full((5,), 3.0)  # a plain tensor: replicated
    return state


def _bump(state: dict, by: float) -> None:
    for value in state["model"].values():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            local.add_(by)


def _zero(state: dict) -> None:
    for value in state["model"].values():
        local = value.to_local() if hasattr(value, "to_local") else value
        local.zero_()


def _local(state: dict) -> dict[str, torch.Tensor]:
    return {
        k: (v.to_local() if hasattr(v, "to_local") else v).clone()
        for k, v in state["model"].items()
    }


class _Sent:
    """Counts what this rank hands to the object collectives (pickled bytes) and
    whether a plan was scattered."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.bytes = 0
        self.scatters = 0
        for name in ("all_gather_object", "gather_object", "broadcast_object_list"):
            self._wrap(dist, name)
        real_scatter = dist.scatter_object_list

        def scatter(*args, **kwargs):
            self.scatters += 1
            inputs = kwargs.get("scatter_object_input_list", args[1] if len(args) > 1 else None)
            if inputs is not None:
                self.bytes += len(pickle.dumps(inputs))
            return real_scatter(*args, **kwargs)

        dist.scatter_object_list = scatter

    def _wrap(self, dist, name: str) -> None:
        real = getattr(dist, name)

        position, keyword = {
            "all_gather_object": (1, "obj"),
            "gather_object": (0, "obj"),
            "broadcast_object_list": (0, "object_list"),
        }[name]

        def counted(*args, **kwargs):
            obj = kwargs[keyword] if keyword in kwargs else args[position]
            self.bytes += len(pickle.dumps(obj))
            return real(*args, **kwargs)

        setattr(dist, name, counted)


def _count_calls(cls: type, name: str) -> list[int]:
    """Wrap ``cls.name`` in this process; the list grows by one per call."""
    calls: list[int] = []
    real = getattr(cls, name)

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    setattr(cls, name, counted)
    return calls


def repeated_saves_worker(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ckpt.saving import planning
    from ckpt.saving.writer import BlockSavePlanner

    planned = _count_calls(BlockSavePlanner, "create_global_plan")
    local_plans = _count_calls(DefaultSavePlanner, "create_local_plan")
    sent = _Sent()
    state = _state(world, rank)
    rows = []
    for step in (1, 2, 3):
        _bump(state, 1.0)
        before, scatters = sent.bytes, sent.scatters
        ckpt.save(state, root, step)
        rows.append(
            {"step": step, "planned": len(planned), "bytes": sent.bytes - before,
             "scattered": sent.scatters - scatters, "local_plans": len(local_plans)}
        )  # fmt: skip
    saved3 = _local(state)

    # Stock DCP reads the save that took its kept plan, tensors and Python values.
    _zero(state)
    state["meta"] = {"name": "", "epoch": 0}
    dcp.load(state, checkpoint_id=os.path.join(root, checkpoint_dirname(3)))
    stock_equal = all(torch.equal(saved3[k], v) for k, v in _local(state).items())
    stock_equal = stock_equal and state["meta"] == {"name": "run", "epoch": 1}

    # A layout that changed is planned again, and its new item is in the metadata.
    grown = _state(world, rank, extra=True)
    ckpt.save(grown, root, 4)
    after_change = len(planned)
    ckpt.save(grown, root, 5)
    after_repeat = len(planned)

    # A rank that no longer holds the plan (here: forgot it) makes every rank plan again.
    if rank == 1:
        planning.kept_plans().clear()
    ckpt.save(grown, root, 6)
    after_forgot = len(planned)

    check = _state(world, rank, extra=True)
    _zero(check)
    dcp.load(check, checkpoint_id=os.path.join(root, checkpoint_dirname(6)))
    return {
        "rows": rows,
        "stock_equal": stock_equal,
        "after_change": after_change,
        "after_repeat": after_repeat,
        "after_forgot": after_forgot,
        "added": check["model"]["added"].tolist(),
    }


def test_a_repeated_layout_exchanges_no_plans_and_stock_dcp_reads_it(tmp_path):
    out = run_ok(repeated_saves_worker, 2, str(tmp_path / "root"), timeout_s=240)
    coordinator, other = out
    # DCP's local planning ran once per rank: the later saves took the kept local plan ...
    for result in out:
        assert [r["local_plans"] for r in result["rows"]] == [1, 1, 1]
    # ... and global planning ran on the coordinator for the first save only ...
    assert [r["planned"] for r in coordinator["rows"]] == [1, 1, 1]
    assert [r["planned"] for r in other["rows"]] == [0, 0, 0]
    # ... and no rank received a scattered plan afterwards.
    for result in out:
        assert [r["scattered"] > 0 for r in result["rows"]] == [True, False, False]
        first, second, third = (r["bytes"] for r in result["rows"])
        assert second * 3 < first and third * 3 < first, result["rows"]
        assert result["stock_equal"]
    # A new item: planned again (once), kept for the save after it.
    assert coordinator["after_change"] == 2 and coordinator["after_repeat"] == 2
    # Rank 1 forgot the plan: the coordinator planned again instead of either side hanging.
    assert coordinator["after_forgot"] == 3
    # The new item is in the metadata: stock DCP reads it back.
    assert out[0]["added"] == [3.0] * 5 and out[1]["added"] == [3.0] * 5


def failing_write_worker(rank: int, world: int, root: str) -> dict:
    from ckpt.saving.writer import ShardWriter

    state = _state(world, rank)
    ckpt.save(state, root, 1)
    real = ShardWriter.write_data

    def broken(self, plan, planner):
        raise OSError("disk gone")

    if rank == 1:
        ShardWriter.write_data = broken
    error = ""
    try:
        ckpt.save(state, root, 2)  # the kept plan: the failure must still reach every rank
    except ckpt.CheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    ShardWriter.write_data = real
    _bump(state, 1.0)
    ckpt.save(state, root, 3)
    return {
        "error": error,
        "steps": sorted(c.step for c in ckpt.list_checkpoints(root) if c.committed),
    }


def test_a_failed_write_on_a_kept_plan_fails_the_save_on_every_rank(tmp_path):
    out = run_ok(failing_write_worker, 2, str(tmp_path / "root"), timeout_s=240)
    for result in out:
        assert result["error"].startswith("SaveFailedError"), result
        assert "rank 1" in result["error"] and "disk gone" in result["error"]
        assert result["steps"] == [1, 3]


def test_a_kept_local_plan_is_the_one_dcp_makes_and_only_for_the_same_items():
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ckpt.saving.writer import BlockSavePlanner, kept_local_plans, local_plan_signature

    def plan(cls, state):
        planner = cls()
        planner.set_up_planner(state_dict=state, is_coordinator=True)
        return planner.create_local_plan()

    def state(**changes):
        base = {"a": torch.zeros(4, 3), "b": {"c": torch.ones(2)}, "n": 3}
        base.update(changes)
        return base

    kept_local_plans().clear()
    first = plan(BlockSavePlanner, state())
    again = plan(BlockSavePlanner, state(a=torch.ones(4, 3), n=7))  # values only
    assert len(kept_local_plans().snapshot()) == 1  # the second came from the first
    assert again == first == plan(DefaultSavePlanner, state())
    variants = [
        state(a=torch.zeros(4, 4)),
        state(a=torch.zeros(4, 3, dtype=torch.float64)),
        state(a=torch.zeros(4, 3, requires_grad=True)),
        state(a=torch.nn.Parameter(torch.zeros(4, 3))),
        state(n=torch.tensor(3)),  # a value became a tensor
        state(extra=1),
    ]
    for changed in variants:
        assert plan(BlockSavePlanner, changed) == plan(DefaultSavePlanner, changed)
    # A Parameter plans as a tensor that requires grad: the same signature, the same plan.
    distinct = [state(), *variants[:3], *variants[4:]]
    signatures = {local_plan_signature(flatten_state_dict(s)[0], True) for s in distinct}
    assert len(signatures) == len(distinct)
    flat = flatten_state_dict(state())[0]
    assert local_plan_signature(flat, True) != local_plan_signature(flat, False)


def test_the_layout_digest_covers_what_the_global_plan_depends_on():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ckpt.saving.planning import layout_digest
    from ckpt.saving.writer import BlockSavePlanner

    def digest(state, *, rank=0, world=2, planner_cls=BlockSavePlanner):
        planner = planner_cls()
        planner.set_up_planner(state_dict=state, is_coordinator=rank == 0)
        return layout_digest(planner.create_local_plan(), rank=rank, world_size=world,
                             planner=planner)  # fmt: skip

    base = {"a": torch.zeros(4, 3), "b": torch.zeros(2), "c": {"x": 1}}
    same = {"a": torch.ones(4, 3), "b": torch.ones(2), "c": {"x": 2}}  # values differ only
    assert digest(base) == digest(same)
    assert digest(base) != digest({**base, "b": torch.zeros(3)})  # shape
    assert digest(base) != digest({**base, "b": torch.zeros(2, dtype=torch.float64)})  # dtype
    assert digest(base) != digest({**base, "d": torch.zeros(1)})  # a new item
    assert digest(base) != digest({"a": base["a"], "c": base["c"]})  # an item gone
    assert digest(base) != digest(base, rank=1)
    assert digest(base) != digest(base, world=3)
    assert digest(base) != digest(base, planner_cls=DefaultSavePlanner)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen, dtype=torch.float64) * 100
    if dtype == torch.bool:
        return values > 0
    if dtype == torch.complex64:
        return torch.complex(values.float(), -values.float())
    return values.to(dtype)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64]
)
def test_a_kept_template_writes_the_bytes_torch_save_writes(dtype):
    import io

    from ckpt.format.tensorblob import zip_records
    from ckpt.saving.writer import SaveTemplates, _torch_save, zip_crc32_off

    templates = SaveTemplates()
    with zip_crc32_off():
        for shape in [(), (0,), (3,), (4, 5), (5, 4)]:  # same dtype, shapes apart
            first, second = _tensor(dtype, shape, 1), _tensor(dtype, shape, 2)
            templates.serialize(first)
            written = bytes(templates.serialize(second))
            expected = bytes(_torch_save(second))
            assert len(written) == len(expected)
            # Only the archive's serialization id (the first tensor's) may differ.
            records = zip_records(memoryview(expected))
            sid = next(v for k, v in records.items() if k.endswith(".data/serialization_id"))
            differ = [i for i, (x, y) in enumerate(zip(written, expected)) if x != y]
            assert all(sid[0] <= i < sid[0] + sid[1] for i in differ), (shape, differ[:5])
            loaded = torch.load(io.BytesIO(written), weights_only=True)
            assert loaded.dtype == dtype and torch.equal(loaded, second)
    assert len(templates._kept) == 5  # every one of them came from a template


def test_tensors_a_template_cannot_describe_are_torch_saved():
    import io

    from ckpt.saving.writer import SaveTemplates, zip_crc32_off

    templates = SaveTemplates()
    complex_ = _tensor(torch.complex64, (3,), 1)
    kinds = [
        _tensor(torch.float32, (4, 6), 1).t(),  # not contiguous
        complex_.conj(),  # a conjugate bit
        torch.nn.Parameter(torch.ones(3)),  # a subclass
    ]
    with zip_crc32_off():
        for tensor in kinds:
            for _ in range(2):
                loaded = torch.load(io.BytesIO(bytes(templates.serialize(tensor))))
                assert torch.equal(loaded, tensor.detach().resolve_conj())
    assert len(templates._kept) == 0
    # With the zip crc32 on, nothing is kept (its values are the first tensor's).
    templates.serialize(torch.ones(3))
    assert len(templates._kept) == 0


def load_worker(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    from ckpt.storage import StorageOptions

    state = _state(world, rank)
    _bump(state, 5.0)
    saved = _local(state)
    ckpt.save(state, root, 1)
    scatters = []
    real = dist.scatter_object_list

    def counted(*args, **kwargs):
        scatters.append(1)
        return real(*args, **kwargs)

    dist.scatter_object_list = counted
    out = {}
    for read_once in (False, True):
        _zero(state)
        state["meta"] = {"name": "", "epoch": 0}
        before = len(scatters)
        ckpt.load(state, root, storage_options=StorageOptions(read_once=read_once))
        out[f"read_once={read_once}"] = {
            "scattered": len(scatters) - before,
            "equal": all(torch.equal(saved[k], v) for k, v in _local(state).items()),
            "meta": state["meta"],
        }
    return out


def test_a_load_exchanges_plans_only_for_read_once_sharing(tmp_path):
    out = run_ok(load_worker, 2, str(tmp_path / "root"), timeout_s=240)
    for result in out:
        # Each rank reads what its own plan says: no plan gathered and scattered ...
        assert result["read_once=False"]["scattered"] == 0
        # ... unless items are shared out among the ranks, which is planned globally.
        assert result["read_once=True"]["scattered"] == 1
        for case in result.values():
            assert case["equal"] and case["meta"] == {"name": "run", "epoch": 1}


def test_the_coordinator_rebuilds_only_the_write_results_that_moved():
    import array

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    from ckpt.saving.planning import KeptPlan

    items = [WriteItem(index=MetadataIndex(f"k{i}"), type=WriteItemType.BYTE_IO) for i in range(4)]
    plan = SavePlan(items)
    kept = KeptPlan(plan=plan, all_plans=[plan], metadata=None, rank=0, world_size=1)

    def payload(*extents):
        return "rank_00000.distcp", array.array(
            "q", [x for pair in extents for x in pair]
        ).tobytes()

    first = kept.results(0, payload((0, 10), (10, 5), (15, 7), (22, 3)))
    assert [(r.storage_data.offset, r.storage_data.length) for r in first] == [
        (0, 10), (10, 5), (15, 7), (22, 3)
    ]  # fmt: skip
    assert [r.index for r in first] == [item.index for item in items]
    assert kept.results(0, payload((0, 10), (10, 5), (15, 7), (22, 3))) is first
    moved = kept.results(0, payload((0, 10), (10, 5), (15, 9), (24, 3)))
    assert moved[0] is first[0] and moved[1] is first[1]  # not rebuilt
    assert [(r.storage_data.offset, r.size_in_bytes) for r in moved[2:]] == [(15, 9), (24, 3)]
    with pytest.raises(ValueError, match="write results of 3 items for a plan of 4"):
        kept.results(0, payload((0, 1), (1, 1), (2, 1)))


def swapped_ranks_worker(rank: int, world: int, root: str, init_file: str) -> dict:
    """Two saves of a layout on 3 ranks, then the same processes in a new group with ranks
    1 and 2 swapped (an in-process restart) save it again: nothing kept at the old rank
    may be taken for the new one (a DTensor's mesh compares equal across ranks, and the
    digests of two swapped ranks of a replicated layout are each other's)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckpt.saving.writer import BlockSavePlanner

    planned = _count_calls(BlockSavePlanner, "create_global_plan")
    state = _state(world, rank)
    ckpt.save(state, root, 1)
    ckpt.save(state, root, 2)
    dist.barrier()
    dist.destroy_process_group()  # the caches stay: nothing told ckpt
    swapped = {0: 0, 1: 2, 2: 1}[rank]  # the coordinator stays; ranks 1 and 2 swap
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=swapped,
                            world_size=world)  # fmt: skip
    now = dist.get_rank()
    state = _state(world, now)
    _bump(state, 10.0)  # the same on both ranks: the plain tensor is replicated
    saved = _local(state)
    before = len(planned)
    ckpt.save(state, root, 3)
    check = _state(world, now)
    _zero(check)
    check["meta"] = {"name": "", "epoch": 0}
    dcp.load(check, checkpoint_id=os.path.join(root, checkpoint_dirname(3)))
    return {
        "rank": now,
        "planned_again": len(planned) - before,
        "equal": {k: torch.equal(saved[k], v) for k, v in _local(check).items()},
        "meta": check["meta"],
    }


def test_processes_that_swapped_ranks_plan_again_and_save_their_own_shards(tmp_path):
    out = run_ok(swapped_ranks_worker, 3, str(tmp_path / "root"), str(tmp_path / "swap"),
                 timeout_s=240)  # fmt: skip
    by_rank = {r["rank"]: r for r in out}
    assert set(by_rank) == {0, 1, 2}
    assert by_rank[0]["planned_again"] == 1  # the coordinator planned the layout again
    for result in out:
        assert all(result["equal"].values()), result["equal"]
        assert result["meta"] == {"name": "run", "epoch": 1}


def test_releasing_the_groups_forgets_the_kept_plans(tmp_path):
    from ckpt.dist import release_groups
    from ckpt.saving.planning import kept_plans
    from ckpt.saving.writer import kept_local_plans

    ckpt.save({"a": torch.ones(3), "n": 1}, str(tmp_path), 1)
    assert kept_plans().snapshot() and kept_local_plans().snapshot()
    release_groups()
    assert not kept_plans().snapshot() and not kept_local_plans().snapshot()
    ckpt.save({"a": torch.ones(3), "n": 2}, str(tmp_path), 2)  # plans anew
    assert kept_plans().snapshot()
