"""The ``scale`` group: the coordinator's share of a save's planning at R ranks x T tensors,
simulated in one process (no ranks are started: the plans are built as DCP's data).

Every rank of the simulated job holds T row shards (8 rows of 64 float32 columns) of T
tensors sharded over all R ranks, FSDP-like, plus one Python value (a step counter),
as the local plans DCP's ``DefaultSavePlanner`` makes. Per (R, T), in one process:

- DCP: ``DefaultSavePlanner().create_global_plan`` of the R local plans (deduplication,
  the metadata, the validation of every tensor's chunks), which ``dcp.save`` runs on its
  coordinator at every save;
- ours: what our coordinator does at a save of a layout the ranks planned before
  (:mod:`ckpt.saving.planning`): the layout key of the R digests and whether every rank
  holds its plan (:func:`~ckpt.saving.planning.agreed_layout`), then every rank's write
  results from its payload (:meth:`~ckpt.saving.planning.KeptPlan.results`), where each
  rank's Python value changed its length since the last save.

Both sides then build the same metadata and pickle it into ``.metadata``, not timed here.
Bytes each rank sends per save are counted as pickled: ours (its digest and held keys,
then its write payload) and DCP's (its local plan, the final plan scattered to it, its
write results). Metrics (:func:`bench.metrics.scale_metrics`): ``plan_scale_vs_dcp``
(ours / DCP at the largest point DCP runs), ``plan_scale_rank_exp`` (the growth exponent
of ours in R at the largest T) and ``plan_bytes_per_rank`` (ours, per save, at that T).
"""

from __future__ import annotations

import array
import gc
import hashlib
import pickle
import statistics
import time
from dataclasses import dataclass
from typing import Any

ROWS = 8
COLUMNS = 64


@dataclass(frozen=True, slots=True)
class ScaleMode:
    ranks: tuple[int, ...]
    """R of each point, at T = ``tensors``."""
    tensors: int
    dcp_max_ranks: int
    """DCP runs up to this R (its planning at the larger R takes minutes)."""
    rounds: int


QUICK = ScaleMode(ranks=(16, 64, 256), tensors=256, dcp_max_ranks=256, rounds=3)
FULL = ScaleMode(ranks=(64, 256, 1024, 4096), tensors=1024, dcp_max_ranks=1024, rounds=3)


def local_plans(ranks: int, tensors: int) -> list[Any]:
    """The R local plans DCP's planner makes for the simulated job (see the module)."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    props = TensorProperties(dtype=torch.float32)
    size = torch.Size([ranks * ROWS, COLUMNS])
    rows = torch.Size([ROWS, COLUMNS])
    names = [f"model.layers.{t}.weight" for t in range(tensors)]
    mappings = {name: ("model", f"layers.{t}.weight") for t, name in enumerate(names)}
    mappings["step"] = ("step",)
    plans = []
    for rank in range(ranks):
        offsets = torch.Size([rank * ROWS, 0])
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=rows)
        data = TensorWriteData(chunk=chunk, properties=props, size=size)
        items = [
            WriteItem(
                index=MetadataIndex(name, offsets), type=WriteItemType.SHARD, tensor_data=data
            )
            for name in names
        ]
        items.append(WriteItem(index=MetadataIndex("step"), type=WriteItemType.BYTE_IO))
        plans.append(SavePlan(items, planner_data=mappings))
    return plans


def _payload(plan: Any, filename: str, step_bytes: int) -> tuple[str, bytes]:
    """A rank's write payload (:func:`ckpt.saving.planning._compact`'s form): its tensor
    items back to back, then the Python value of ``step_bytes``."""
    extents = array.array("q")
    offset = 0
    for item in plan.items:
        if item.tensor_data is not None:
            length = ROWS * COLUMNS * 4 + 1100  # raw bytes + torch.save's archive around them
            extents.extend((offset, length))
            offset += length
    for item in plan.items:
        if item.tensor_data is None:
            extents.extend((offset, step_bytes))
            offset += step_bytes
    # Extents follow the plan's item order: the value is last in these plans as well.
    return filename, extents.tobytes()


def _timed(fn: Any) -> float:
    gc.collect()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def point(ranks: int, tensors: int, rounds: int, with_dcp: bool) -> dict[str, Any]:
    """One (R, T): medians of ``rounds`` of each side and the bytes a rank sends."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    from ckpt.format.layout import shard_filename
    from ckpt.saving.planning import KeptPlan, agreed_layout

    plans = local_plans(ranks, tensors)
    out: dict[str, Any] = {"ranks": ranks, "tensors": tensors}
    final = None
    if with_dcp:
        dcp_s = []
        for _ in range(rounds):
            holder: dict[str, Any] = {}
            dcp_s.append(
                _timed(
                    lambda h=holder: h.update(out=DefaultSavePlanner().create_global_plan(plans))
                )
            )
            final = holder["out"][0]
        out["dcp_s"] = statistics.median(dcp_s)
    # The final plans of this job are the local ones (no item is replicated): what our
    # coordinator keeps after the first save, with each rank's file name.
    kept_plans = [
        type(plan)(plan.items, storage_data=shard_filename(rank), planner_data=plan.planner_data)
        for rank, plan in enumerate(plans)
    ]
    kept = KeptPlan(
        plan=kept_plans[0], all_plans=kept_plans, metadata=None, rank=0, world_size=ranks
    )
    digests = [hashlib.sha256(str(rank).encode()).digest() for rank in range(ranks)]
    key = hashlib.sha256(b"".join(digests)).digest()
    summaries = [(digest, [key]) for digest in digests]
    payloads = [_payload(p, shard_filename(r), 20) for r, p in enumerate(kept_plans)]
    for rank, payload in enumerate(payloads):  # the save before: every result built
        kept.results(rank, payload)
    ours_s = []
    for round_ in range(rounds):
        step_bytes = 21 + round_  # the value's encoding grew: its extent moved
        changed = [_payload(p, shard_filename(r), step_bytes) for r, p in enumerate(kept_plans)]

        def coordinator(changed: list[tuple[str, bytes]] = changed) -> None:
            _, held = agreed_layout(summaries)
            assert held
            for rank, payload in enumerate(changed):
                kept.results(rank, payload)

        ours_s.append(_timed(coordinator))
    out["ours_s"] = statistics.median(ours_s)
    # Bytes one rank (rank 1: not the coordinator) sends per save.
    ours_bytes = len(pickle.dumps(summaries[1])) + len(pickle.dumps(payloads[1]))
    results = [
        WriteResult(
            index=item.index, size_in_bytes=length, storage_data=_StorageInfo("f", offset, length)
        )
        for item, (offset, length) in zip(kept_plans[1].items, _pairs(payloads[1][1]), strict=True)
    ]
    scattered = final[1] if final is not None else kept_plans[1]
    dcp_bytes = (
        len(pickle.dumps(plans[1])) + len(pickle.dumps(scattered)) + len(pickle.dumps(results))
    )
    out["ours_bytes_per_rank"] = ours_bytes
    out["dcp_bytes_per_rank"] = dcp_bytes
    return out


def _pairs(raw: bytes) -> list[tuple[int, int]]:
    values = array.array("q")
    values.frombytes(raw)
    return [(values[i], values[i + 1]) for i in range(0, len(values), 2)]


def measure(mode: ScaleMode, progress: Any = print) -> dict[str, Any]:
    """Every point of ``mode``; raw results for :func:`bench.metrics.scale_metrics`."""
    points = []
    for ranks in mode.ranks:
        started = time.perf_counter()
        got = point(ranks, mode.tensors, mode.rounds, with_dcp=ranks <= mode.dcp_max_ranks)
        points.append(got)
        dcp = f", DCP {got['dcp_s']:.3f} s" if "dcp_s" in got else ""
        progress(
            f"scale: {ranks} ranks x {mode.tensors} tensors: ours {got['ours_s']:.4f} s{dcp} "
            f"({time.perf_counter() - started:.0f} s)"
        )
        gc.collect()
    return {"tensors": mode.tensors, "points": points}


def curve(raw: dict[str, Any]) -> dict[str, Any]:
    """The simulation as a curve for :func:`bench.curve_plots.plot_curve`: time and bytes
    per save against R, ours and DCP."""
    from bench.metrics import growth_exponent

    points = raw["points"]
    x = [float(p["ranks"]) for p in points]

    def line(lines: dict[str, list[float | None]], unit: str) -> dict[str, Any]:
        exps = {}
        for side, values in lines.items():
            pairs = [(a, b) for a, b in zip(x, values, strict=True) if b]
            exps[side] = growth_exponent([a for a, _ in pairs], [b for _, b in pairs])
        return {"x": x, "lines": lines, "unit": unit, "exponents": exps}

    return {
        "title": f"planning at scale, simulated: R ranks x {raw['tensors']} tensors",
        "x_label": "ranks",
        "series": {
            "coordinator's planning per save": line(
                {"ours": [p["ours_s"] for p in points],
                 "dcp": [p.get("dcp_s") for p in points]}, "s"),
            "bytes a rank sends per save": line(
                {"ours": [float(p["ours_bytes_per_rank"]) for p in points],
                 "dcp": [float(p["dcp_bytes_per_rank"]) for p in points]}, "bytes"),
        },
    }  # fmt: skip
