"""The save collective: DCP's protocol, without exchanging plans the ranks already agree on.

``dcp.save`` gathers every rank's local plan (pickled, one object per item) on the
coordinator, builds and validates the global plan there and scatters it back, then
gathers every rank's write results (one object per item again) and broadcasts the
whole metadata to every rank. A training job saves the same layout (the same tensors,
shapes, shardings and ranks) over and over; all of that per-item traffic is then the
same each time, and at tens of thousands of tensors it is most of a save.

:func:`save_state` runs the same steps through the same planner and writer methods
(``set_up_planner``, ``create_local_plan``, ``prepare_local_plan``, the coordinator's
``create_global_plan`` and ``prepare_global_plan``, ``finish_plan``, ``write_data``,
the coordinator's ``finish``), so the files and ``.metadata`` are exactly those of
``dcp.save``, and differs in what crosses the wire:

- every rank sends a digest of its local plan (:func:`layout_digest`: every item's
  key, chunk, global size and tensor properties, and the rank and world size); when
  every rank's digest is that of a save this process group already planned, and every
  rank still holds that plan (the ranks say which they hold), each rank takes its
  final plan from :func:`kept_plans` and no plan is exchanged;
- otherwise (the first save, a layout that changed, a rank that restarted) the plans
  are gathered and the global plan scattered as DCP does, and the outcome is kept;
- write results travel as one byte string per rank (offset and length of each item
  of its final plan, in order), rebuilt into DCP's ``WriteResult`` on the coordinator
  from the plans it kept; only the outcome (ok or every rank's failure) is broadcast.

A failure on any rank at any step raises the same ``CheckpointException`` on every
rank, as ``dcp.save`` does.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

import numpy as np
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper

from ckpt.defaults import process_defaults
from ckpt.dist import Collective

KEPT_LAYOUTS = 2
"""Global plans a process keeps (the most recently used): a job saves one layout, or two
(its training state and another staging of it). The coordinator's hold every rank's
plan and write results: millions of objects at thousands of ranks."""


@dataclasses.dataclass(frozen=True, slots=True)
class KeptPlan:
    """What a rank keeps of one planned layout: its own final plan and, on the
    coordinator, every rank's final plan and the metadata they make."""

    plan: SavePlan
    all_plans: list[SavePlan] | None
    metadata: Metadata | None
    rank: int
    """This process's rank in the group it planned in: a kept plan is offered again only at
    that rank (processes that swapped ranks have equal digests, not equal plans)."""
    world_size: int
    written: dict[int, tuple[str, bytes, list[WriteResult]]] = dataclasses.field(
        default_factory=dict
    )
    """Coordinator: each rank's write results of the last save of this layout, with the
    payload they came from; a rank whose items landed where they did last time (tensor
    items do: the writer puts them first) has its results reused, not rebuilt."""

    def results(
        self, rank: int, payload: tuple[str, bytes] | list[WriteResult]
    ) -> list[WriteResult]:
        """Rank ``rank``'s ``WriteResult``s from its payload (:func:`_compact`)."""
        assert self.all_plans is not None
        if isinstance(payload, list):
            return payload
        path, raw = payload
        plan = self.all_plans[rank]
        if len(raw) != 16 * len(plan.items):
            raise ValueError(
                f"rank {rank} sent write results of {len(raw) // 16} items for a plan of "
                f"{len(plan.items)}"
            )
        last = self.written.get(rank)
        if last is not None and last[0] == path and last[1] == raw:
            return last[2]
        if last is not None and last[0] == path:
            results = list(last[2])
            old = _extents(last[1])
            new = _extents(raw)
            for i in (old != new).any(axis=1).nonzero()[0].tolist():
                results[i] = _result(plan.items[i], path, int(new[i, 0]), int(new[i, 1]))
        else:
            new = _extents(raw)
            results = [
                _result(item, path, offset, length)
                for item, (offset, length) in zip(plan.items, new.tolist(), strict=True)
            ]
        self.written[rank] = (path, raw, results)
        return results


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """A few values by key, the least recently used dropped first; thread-safe."""

    def __init__(self, size: int = KEPT_LAYOUTS) -> None:
        self.size = size
        self._kept: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._kept.get(key)
            if value is not None:
                self._kept.move_to_end(key)
            return value

    def snapshot(self) -> dict[K, V]:
        with self._lock:
            return dict(self._kept)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._kept[key] = value
            self._kept.move_to_end(key)
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()


PlanCache = LruCache[bytes, KeptPlan]
"""Global plans by the digests of every rank's local plan."""


def kept_plans() -> PlanCache:
    """This process's kept global plans (in :mod:`ckpt.defaults`, made on first use)."""
    return process_defaults().part("save_plans", PlanCache, per_group=True)


@dataclasses.dataclass(frozen=True, slots=True)
class SaveExchange:
    """How one :func:`save_state` went: whether the plans were exchanged (False: every
    rank took its kept plan), and the key of the layout (the digest of every rank's)."""

    planned: bool
    layout_key: bytes


def layout_digest(plan: SavePlan, *, rank: int, world_size: int, planner: SavePlanner) -> bytes:
    """A digest of everything of a local plan that the global plan depends on.

    Two local plans with the same digest give the same global plan, given the same
    digests on every other rank: the digest covers each item's key (name, offset,
    index hint), kind, chunk, global size and tensor properties in order, the
    planner's own data (the flattening of the state's keys) and settings, and the
    rank's place in the group.
    """
    h = hashlib.sha256()
    h.update(f"{type(planner).__module__}.{type(planner).__qualname__}".encode())
    settings = ("block_bytes", "flatten_state_dict", "flatten_sharded_tensors",
                "dedup_save_to_lowest_rank", "_enable_plan_caching")  # fmt: skip
    h.update(repr([getattr(planner, name, None) for name in settings]).encode())
    h.update(f"|{rank}/{world_size}|".encode())
    h.update(repr(plan.storage_data).encode())
    h.update(repr(_sorted_mapping(plan.planner_data)).encode())
    for item in plan.items:
        h.update(_item_key(item).encode())
    return h.digest()


def _item_key(item: WriteItem) -> str:
    index = item.index
    parts = [index.fqn, repr(tuple(index.offset) if index.offset is not None else None),
             repr(index.index), str(item.type.value)]  # fmt: skip
    data = item.tensor_data
    if data is not None:
        props = data.properties
        parts += [
            repr(tuple(data.chunk.offsets)), repr(tuple(data.chunk.sizes)), repr(tuple(data.size)),
            str(props.dtype), str(props.layout), str(props.requires_grad),
            str(props.memory_format), str(props.pin_memory),
        ]  # fmt: skip
    return "\x1f".join(parts) + "\x1e"


def _sorted_mapping(data: Any) -> Any:
    if isinstance(data, dict):
        return sorted((repr(k), repr(v)) for k, v in data.items())
    return repr(data)


def save_state(
    state: dict[str, Any],
    *,
    writer: StorageWriter,
    planner: SavePlanner,
    coll: Collective,
    cache: PlanCache | None = None,
) -> SaveExchange:
    """Save ``state`` through ``writer`` and ``planner`` on every rank of ``coll``
    (module docstring); raises ``CheckpointException`` on every rank when any failed."""
    cache = kept_plans() if cache is None else cache
    wrapper = _DistWrapper(coll.group, coll.distributed, 0)
    local: dict[str, Any] = {}

    def plan_locally() -> tuple[bytes, list[bytes]]:
        planner.set_up_planner(
            state_dict=state,
            storage_meta=writer.storage_meta(),
            is_coordinator=wrapper.is_coordinator,
        )
        writer.set_up_storage_writer(
            wrapper.is_coordinator, rank=wrapper.rank, use_collectives=True
        )
        plan = writer.prepare_local_plan(planner.create_local_plan())
        local["plan"] = plan
        world = wrapper.get_world_size()
        # What this rank holds, as it tells the others: plans it kept at this very rank
        # (and, on the coordinator, with every rank's plan).
        local["kept"] = {
            key: kept
            for key, kept in cache.snapshot().items()
            if kept.rank == wrapper.rank
            and kept.world_size == world
            and (kept.all_plans is not None or not wrapper.is_coordinator)
        }
        digest = layout_digest(plan, rank=wrapper.rank, world_size=world, planner=planner)
        return digest, list(local["kept"])

    summaries = wrapper.all_gather("plan", plan_locally)
    key, everyone_holds = agreed_layout(summaries)
    planned = not everyone_holds
    if planned:
        kept = _plan_globally(wrapper, planner, writer, local["plan"])
        cache.put(key, kept)
    else:
        kept = local["kept"][key]
        cache.put(key, kept)  # most recently used

    def write() -> tuple[str, bytes] | list[WriteResult]:
        final = planner.finish_plan(kept.plan)
        future = writer.write_data(final, planner)
        future.wait()
        return _compact(final, future.value())

    def finish(payloads: list[tuple[str, bytes] | list[WriteResult]]) -> None:
        assert kept.all_plans is not None and kept.metadata is not None
        results = [kept.results(rank, payload) for rank, payload in enumerate(payloads)]
        # ``finish`` fills in the storage data of this save: on a copy, the kept one stays bare.
        writer.finish(metadata=dataclasses.replace(kept.metadata), results=results)

    wrapper.all_reduce("write", write, finish)
    return SaveExchange(planned=planned, layout_key=key)


def agreed_layout(summaries: list[tuple[bytes, list[bytes]]]) -> tuple[bytes, bool]:
    """From every rank's (layout digest, keys of the plans it holds): the layout's key and
    whether every rank holds its plan.

    Every rank decides from the same gathered summaries, so all take their kept plan or
    none does. A rank offers only plans it kept at its present rank and world size (and
    the coordinator only plans that carry every rank's plan and the metadata), so a kept
    plan is this rank's own even when processes swapped ranks.
    """
    key = hashlib.sha256(b"".join(digest for digest, _ in summaries)).digest()
    return key, all(key in held for _, held in summaries)


def _plan_globally(
    wrapper: _DistWrapper, planner: SavePlanner, writer: StorageWriter, plan: SavePlan
) -> KeptPlan:
    """DCP's plan exchange: gather the local plans, plan globally on the coordinator,
    scatter each rank's final plan."""
    outcome: dict[str, Any] = {}

    def plan_globally(all_plans: list[SavePlan]) -> list[SavePlan]:
        all_plans, metadata = planner.create_global_plan(all_plans)
        all_plans = writer.prepare_global_plan(all_plans)
        outcome["all_plans"], outcome["metadata"] = all_plans, metadata
        return all_plans

    mine = wrapper.reduce_scatter("plan", lambda: plan, plan_globally)
    return KeptPlan(
        plan=mine,
        all_plans=outcome.get("all_plans"),
        metadata=outcome.get("metadata"),
        rank=wrapper.rank,
        world_size=wrapper.get_world_size(),
    )


def _compact(plan: SavePlan, results: list[WriteResult]) -> tuple[str, bytes] | list[WriteResult]:
    """A rank's write results as (file, offset and length of each item of ``plan`` in
    order); the results themselves when they are not all in one file of DCP's
    ``_StorageInfo`` (another writer's)."""
    by_index = {r.index: r for r in results}
    files = {getattr(r.storage_data, "relative_path", None) for r in results}
    if (
        len(by_index) != len(plan.items)
        or len(files) > 1
        or not all(type(r.storage_data) is _StorageInfo for r in results)
        or any(item.index not in by_index for item in plan.items)
    ):
        return results
    extents = array.array("q")
    for item in plan.items:
        info = by_index[item.index].storage_data
        extents.append(info.offset)
        extents.append(info.length)
    return (files.pop() if files else ""), extents.tobytes()


def _extents(raw: bytes) -> np.ndarray:
    """(offset, length) rows of a payload (:func:`_compact`)."""
    return np.frombuffer(raw, dtype=np.int64).reshape(-1, 2)


def _result(item: WriteItem, path: str, offset: int, length: int) -> WriteResult:
    return WriteResult(
        index=item.index,
        size_in_bytes=length,
        storage_data=_StorageInfo(relative_path=path, offset=offset, length=length),
    )
