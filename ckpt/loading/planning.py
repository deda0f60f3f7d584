"""The load collective: DCP's load protocol, with the plans exchanged only when needed.

``dcp.load`` gathers every rank's load plan (pickled, one object per item to read) on
the coordinator and scatters it back, although DCP's own global load planning changes
nothing (``create_default_global_load_plan`` returns the plans as they came). The one
global step that does something here is the shard reader's read-once planning
(:mod:`ckpt.loading.read_once`: items several ranks load, read by one rank and broadcast),
and only when that reader reads once (:meth:`ShardReader.plans_globally`).

:func:`load_state` runs the same planner and reader calls as ``dcp.load``, after one
small all_gather in which each rank says whether it plans globally (and whether its own
planning failed): when none does, each rank reads its own plan and no plan crosses the
wire; otherwise the plans are gathered and scattered as DCP does. A failure on any rank
raises the same ``CheckpointException`` on every rank, as ``dcp.load``'s does.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.utils import _DistWrapper

from ckpt.dist import Collective
from ckpt.loading.reader import ShardReader


def load_state(
    state: dict[str, Any], *, reader: ShardReader, planner: LoadPlanner, coll: Collective
) -> bool:
    """Load ``state`` in place through ``reader`` and ``planner`` on every rank of
    ``coll`` (module docstring); whether the plans were exchanged. Raises
    ``CheckpointException`` on every rank when any rank failed."""
    wrapper = _DistWrapper(coll.group, coll.distributed, 0)
    # Top-level keys in one order on every rank, and values put back as dcp.load does.
    ordered = {key: state[key] for key in sorted(state)}
    local: dict[str, LoadPlan] = {}

    def plan_locally() -> bool:
        metadata = reader.read_metadata()
        planner.set_up_planner(ordered, metadata, wrapper.is_coordinator)
        reader.set_up_storage_reader(
            metadata, wrapper.is_coordinator, rank=wrapper.rank, use_collectives=True
        )
        local["plan"] = reader.prepare_local_plan(planner.create_local_plan())
        return reader.plans_globally() or not _global_planning_is_identity(planner)

    exchanged = any(wrapper.all_gather("plan", plan_locally))
    if exchanged:

        def plan_globally(all_plans: list[LoadPlan]) -> list[LoadPlan]:
            return reader.prepare_global_plan(planner.create_global_plan(all_plans))

        plan = wrapper.reduce_scatter("plan", lambda: local["plan"], plan_globally)
    else:
        plan = local["plan"]

    def read() -> None:
        reader.read_data(planner.finish_plan(plan), planner).wait()

    wrapper.all_gather("read", read)
    for key, value in ordered.items():
        state[key] = value
    return exchanged


def _global_planning_is_identity(planner: LoadPlanner) -> bool:
    """Whether ``planner``'s global step is DCP's default one, which returns the plans
    unchanged (a planner that overrides it gets the exchange)."""
    return (
        isinstance(planner, DefaultLoadPlanner)
        and type(planner).create_global_plan is DefaultLoadPlanner.create_global_plan
        and type(planner).finish_plan is DefaultLoadPlanner.finish_plan
    )
