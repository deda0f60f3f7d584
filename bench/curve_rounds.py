"""What each rank runs for cost curves 1-3 (:mod:`bench.curves`): ours and DCP on the same
state, the same disk, the same ranks, alternating round by round.

Ours is ``ckpt.save`` / ``ckpt.load``; DCP is ``dcp.save`` / ``dcp.load`` through
``FileSystemWriter`` / ``FileSystemReader`` with their defaults (one file per rank,
``sync_files=True``), and ``dcp.async_save`` (its default thread and blocking stager)
against ``ckpt.save(async_save=True)``. A point is one state; for each point, in rounds
whose order of the two sides alternates:

- save (sync): barrier -> save -> barrier, with the peak RSS growth of each rank
  (:class:`bench.memory.PeakRss`) and where rank 0's time went (:data:`SAVE_PHASES`);
  round 0 is a warm-up kept apart;
- one more save per side with the collectives counted (:class:`bench.probe.CollectiveCounter`:
  pickling the payloads to size them costs time, so that save is not timed);
- cold load: the page cache dropped, the state zeroed, barrier -> load -> barrier, peak
  RSS growth; after the last one every rank's tensors must equal what was saved;
- async (optional): the time the call blocks (both sides stage a copy in host memory and
  return), then waiting for the background write, untimed.

The last save of each side stays on disk for the resharding loads (:func:`reshard_rounds`,
in a process group of another size). Every function here runs on every rank of a spawned
gloo group (:func:`bench.spawn.run_on_ranks`) and returns rank 0's view of the samples.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bench import disk
from bench.fsdp_state import build_trained, local_tensor_bytes, sharded_state
from bench.memory import PeakRss
from bench.probe import CollectiveCounter, PhaseTimer
from bench.rounds import _drop_cache, _leaves, _timed, _zero, dist_all_gather

SIDES = ("ours", "dcp")
SAVED_STEP = 1
TENSORS_PER_LAYER = 10
"""A layer of the tensor-count state: q, k, v, o (h x h), up (4h x h), down (h x 4h),
two norms (h), a bias (4h), a 0-d scale (replicated)."""


def save_phases() -> dict[str, list[tuple[Any, str]]]:
    """The methods behind each phase of a save, ours (DCP's protocol through our planner and
    writer, then the manifest) and DCP's own:

    - ``local_plan``: every rank's planning (``create_local_plan``, ``finish_plan``,
      the writer's ``prepare_local_plan``);
    - ``global_plan``: the coordinator's (``create_global_plan``, ``prepare_global_plan``);
    - ``write``: the rank's shard file (``write_data``);
    - ``metadata``: the coordinator's ``.metadata`` (the writer's ``finish``);
    - ``coordinator``: ours only, the coordinator's steps around DCP (preparing the
      directory, the manifest, the fence check, COMPLETE: ``Collective.on_coordinator``).
    """
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    from ckpt.dist import Collective
    from ckpt.saving.writer import BlockSavePlanner, ShardWriter

    return {
        "local_plan": [
            (DefaultSavePlanner, "create_local_plan"),
            (BlockSavePlanner, "create_local_plan"),
            (DefaultSavePlanner, "finish_plan"),
            (_FileSystemWriter, "prepare_local_plan"),
            (ShardWriter, "prepare_local_plan"),
        ],
        "global_plan": [
            (DefaultSavePlanner, "create_global_plan"),
            (_FileSystemWriter, "prepare_global_plan"),
            (ShardWriter, "prepare_global_plan"),
        ],
        "write": [(_FileSystemWriter, "write_data"), (ShardWriter, "write_data")],
        "metadata": [(_FileSystemWriter, "finish"), (ShardWriter, "finish")],
        "coordinator": [(Collective, "on_coordinator")],
    }


COORDINATOR_PHASES = ("global_plan", "metadata", "coordinator")
"""The phases only rank 0 runs while the others wait: its share of the save's critical path."""


# -- states ------------------------------------------------------------------------------


def build_state(spec: dict[str, Any], seed: int) -> tuple[dict[str, Any], Any]:
    """The state of one point: ``{"kind": "fsdp", "width": W}`` (the FSDP2 MLP + AdamW of
    :mod:`bench.fsdp_state`) or ``{"kind": "tensors", "count": N, "bytes": B}``
    (:func:`tensor_count_state`); returns it and what keeps it alive (model, optimizer)."""
    if spec["kind"] == "fsdp":
        model, optim = build_trained(int(spec["width"]), seed=seed)
        return sharded_state(model, optim), (model, optim)
    return tensor_count_state(int(spec["count"]), int(spec["bytes"]), seed), None


def layer_width_for(count: int, total_bytes: int) -> int:
    """``h`` of :func:`tensor_count_state`: ``count / 10`` layers of about ``48 h^2`` bytes."""
    layers = max(1, count // TENSORS_PER_LAYER)
    return max(2, int(math.sqrt(total_bytes / (48 * layers))))


def layer_shapes(h: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and global shapes of one layer of the tensor-count state."""
    return [
        ("q", (h, h)), ("k", (h, h)), ("v", (h, h)), ("o", (h, h)),
        ("up", (4 * h, h)), ("down", (h, 4 * h)),
        ("norm1", (h,)), ("norm2", (h,)), ("bias", (4 * h,)), ("scale", ()),
    ]  # fmt: skip


def tensor_count_state(count: int, total_bytes: int, seed: int) -> dict[str, Any]:
    """``count`` tensors (``count / 10`` transformer-like layers, :func:`layer_shapes`)
    of about ``total_bytes`` in all, fp32: matrices and vectors as DTensors sharded along
    dim 0 over the default group (uneven like FSDP2's: ``torch.chunk`` sizes), 0-d
    scales as plain tensors every rank holds (replicated). Collective-free."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    h = layer_width_for(count, total_bytes)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    out: dict[str, Any] = {}
    for layer in range(max(1, count // TENSORS_PER_LAYER)):
        for name, shape in layer_shapes(h):
            key = f"layers.{layer}.{name}"
            if not shape:
                out[key] = torch.tensor(1.0 + layer)
                continue
            rows = shape[0]
            step = -(-rows // world)
            start = min(rows, rank * step)
            local = torch.randn(min(rows, start + step) - start, *shape[1:], generator=gen)
            stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
            out[key] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
            )
    return {"model": out, "step": 1}


def local_sums(state: Any) -> list[float]:
    """Float64 sum of every tensor this rank holds (a DTensor's local shard), in order:
    equal before a save and after a load into the same sharding when every value is back."""
    from torch.distributed.tensor import DTensor

    sums = []
    for _path, value in _leaves(state):
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            sums.append(float(value.detach().sum(dtype=torch.float64)))
    return sums


def global_sums(state: Any) -> list[float]:
    """Float64 sum of every full tensor (collective: the local sums summed over ranks;
    plain tensors, replicated, counted once). Independent of the sharding, to compare a
    load into another world size with the save (within float rounding)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sums = []
    for _path, value in _leaves(state):
        if isinstance(value, DTensor):
            sums.append(value.to_local().detach().sum(dtype=torch.float64))
        elif isinstance(value, torch.Tensor):
            total = value.detach().sum(dtype=torch.float64)
            sums.append(total if dist.get_rank() == 0 else torch.zeros((), dtype=torch.float64))
    if not sums:
        return []
    flat = torch.stack(sums)
    dist.all_reduce(flat)
    return flat.tolist()


def same_sums(got: list[float], want: list[float], rel: float = 1e-9) -> bool:
    """Whether two lists of sums agree within ``rel`` of the larger magnitude (plus a floor
    for sums near zero)."""
    if len(got) != len(want):
        return False
    return all(abs(a - b) <= rel * max(abs(a), abs(b), 1.0) for a, b in zip(got, want, strict=True))


# -- one point -----------------------------------------------------------------------------


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _files(path: str) -> list[str]:
    return disk.files_under(path) if os.path.isdir(path) else []


class _Point:
    """The rounds of one state on the ranks of the current group (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        world: int,
        work: str,
        spec: dict[str, Any],
        kept: dict[str, str] | None = None,
    ) -> None:
        self.rank, self.world, self.work, self.spec = rank, world, work, spec
        self._kept = kept
        self._async_group: Any = None
        self.state, self._alive = build_state(spec, seed=0)
        self.bytes = local_tensor_bytes(self.state)
        self.saved = local_sums(self.state)
        self.saved_global = global_sums(self.state)
        self.times: dict[str, list[float]] = {}
        self.rss: dict[str, list[int]] = {}
        self.phases: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
        self.checkpoint_bytes: dict[str, int] = {}
        self.kept: dict[str, str] = {}

    def _path(self, side: str, tag: str) -> str:
        if tag == "kept" and self._kept is not None:
            return self._kept[side]
        return os.path.join(self.work, f"{side}_{tag}")

    def _add(self, key: str, seconds: float, growth: int | None = None) -> None:
        self.times.setdefault(key, []).append(seconds)
        if growth is not None:
            self.rss.setdefault(key, []).append(growth)

    def _save_call(self, side: str, path: str, **kwargs: Any) -> Callable[[], Any]:
        import torch.distributed.checkpoint as dcp

        import ckpt

        if side == "ours":
            return lambda: ckpt.save(self.state, path, SAVED_STEP, **kwargs)
        writer = dcp.FileSystemWriter(path)
        if kwargs.get("async_save"):
            # A group of its own, as DCP asks of async saves (ours has its checkpoint
            # group): the background save's collectives must not interleave with the
            # barriers of the timing on the default group.
            if self._async_group is None:
                import torch.distributed as dist

                self._async_group = dist.new_group(backend="gloo")
            group = self._async_group
            return lambda: dcp.async_save(self.state, storage_writer=writer, process_group=group)
        return lambda: dcp.save(self.state, storage_writer=writer)

    def save(self, side: str, tag: str, timed: bool = True) -> None:
        path = self._path(side, tag)
        call = self._save_call(side, path)
        with PhaseTimer(save_phases()) as phases, PeakRss() as peak:
            seconds = _timed(call)
        if timed:
            self._add(f"save_{side}", seconds, peak.growth)
            self.phases[side].append({"total": seconds, **phases.seconds})
        else:
            self._add(f"first_save_{side}", seconds)

    def count_collectives(self, side: str) -> dict[str, Any]:
        import torch.distributed as dist

        path = self._path(side, "counted")
        call = self._save_call(side, path)
        dist.barrier()
        with CollectiveCounter() as counter:
            call()
        dist.barrier()
        per_rank = dist_all_gather({"counts": counter.counts, "bytes": counter.bytes})
        if self.rank == 0:
            _remove(path)
        return {"rank0_counts": per_rank[0]["counts"], "per_rank": per_rank}

    def load(self, side: str, tag: str, cold: bool = True, timed: bool = True) -> None:
        import torch.distributed.checkpoint as dcp

        import ckpt

        path = self._path(side, tag)
        _zero(self.state)
        if cold:
            _drop_cache(self.rank, _files(path))
        if side == "ours":
            call: Callable[[], Any] = lambda: ckpt.load(self.state, path)  # noqa: E731
        else:
            reader = dcp.FileSystemReader(path)
            call = lambda: dcp.load(self.state, storage_reader=reader)  # noqa: E731
        with PeakRss() as peak:
            seconds = _timed(call)
        if timed:
            self._add(f"load_{side}", seconds, peak.growth)

    def check(self, what: str) -> None:
        if local_sums(self.state) != self.saved:
            raise RuntimeError(f"{what}: rank {self.rank}'s loaded values differ from the saved")

    def async_save(self, side: str, tag: str, timed: bool = True) -> None:
        import torch.distributed as dist

        path = self._path(side, tag)
        call = self._save_call(side, path, async_save=True)
        handle: list[Any] = []
        seconds = _timed(lambda: handle.append(call()))
        if side == "ours":
            handle[0].wait()
        else:
            handle[0].result()
        dist.barrier()
        if timed:
            self._add(f"async_{side}", seconds)

    def remove(self, *tags: str) -> None:
        import torch.distributed as dist

        dist.barrier()
        if self.rank == 0:
            for side in SIDES:
                for tag in tags:
                    _remove(self._path(side, tag))
        dist.barrier()

    def sizes(self) -> dict[str, int]:
        """Bytes of the kept checkpoints and of their metadata files (rank 0)."""
        from ckpt.format.layout import DCP_METADATA_NAME, MANIFEST_NAME, checkpoint_dirname

        ours = os.path.join(self._path("ours", "kept"), checkpoint_dirname(SAVED_STEP))
        dcp_dir = self._path("dcp", "kept")
        return {
            "ours_bytes": sum(os.path.getsize(p) for p in _files(ours)),
            "dcp_bytes": sum(os.path.getsize(p) for p in _files(dcp_dir)),
            "ours_manifest_bytes": os.path.getsize(os.path.join(ours, MANIFEST_NAME)),
            "ours_metadata_bytes": os.path.getsize(os.path.join(ours, DCP_METADATA_NAME)),
            "dcp_metadata_bytes": os.path.getsize(os.path.join(dcp_dir, DCP_METADATA_NAME)),
        }

    def close(self) -> None:
        self.state = self._alive = None
        gc.collect()


def _order(i: int) -> tuple[str, ...]:
    return SIDES if i % 2 == 0 else SIDES[::-1]


def point_rounds(
    rank: int, world: int, work: str, points: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The ``points`` one after the other; each is ``{"spec": ..., "rounds": N, "async":
    bool, "collectives": bool}`` (:func:`build_state`'s spec, steady rounds, whether to
    run the async rounds and the counted saves). Rank 0 gets one dict of samples per
    point. Every point starts with one untimed save per side (round 0: the first save of a
    layout; ours plans it and reuses the plan in every later save of it, as a training job
    does; its time is kept apart as ``first_save_<side>``); the first point also warms up
    the code paths with one untimed load per side."""
    import ckpt

    out = []
    for index, todo in enumerate(points):
        started = time.monotonic()
        spec, n, first = todo["spec"], int(todo["rounds"]), index == 0
        point = _Point(rank, world, os.path.join(work, f"point{index}"), spec)
        for i in range(0, n + 1):  # round 0: the first save of this layout, untimed
            tag = "kept" if i == n else f"r{i}"
            for side in _order(i):
                point.save(side, tag, timed=i > 0)
            if i < n:
                point.remove(tag)
        collectives = (
            {side: point.count_collectives(side) for side in SIDES} if todo["collectives"] else {}
        )
        sizes = point.sizes() if rank == 0 else {}
        if first:
            for side in SIDES:
                point.load(side, "kept", cold=False, timed=False)
        for i in range(n):
            for side in _order(i):
                point.load(side, "kept")
                if i == n - 1:
                    point.check(f"{side} load of {spec}")
        if todo["async"]:
            for i in range(0 if first else 1, n + 1):
                for side in _order(i):
                    point.async_save(side, f"a{i}", timed=i > 0)
                point.remove(f"a{i}")
            ckpt.close()  # frees our staging buffers before the next, larger state
        out.append(
            {
                "spec": spec,
                "world": world,
                "times": point.times,
                "rank_rss_growth": dist_all_gather(point.rss),
                "rank_state_bytes": dist_all_gather(point.bytes),
                "rank_phases": dist_all_gather(point.phases),
                "collectives": collectives,
                "kept": {side: point._path(side, "kept") for side in SIDES},
                "saved_sums": point.saved_global,
                **sizes,
            }
        )
        point.close()
        _said(rank, f"point {index + 1}/{len(points)} ({_describe(spec)}, {world} ranks)", started)
    return out if rank == 0 else []


def _describe(spec: dict[str, Any]) -> str:
    if spec["kind"] == "fsdp":
        return f"FSDP2 MLP width {spec['width']}"
    return f"{spec['count']} tensors, {spec['bytes'] >> 20} MB"


def _said(rank: int, what: str, started: float) -> None:
    """Progress from rank 0 of a spawned group (stderr is the bench's)."""
    if rank == 0:
        took = time.monotonic() - started
        print(f"bench: curves: {what} done in {took:.0f} s", file=sys.stderr, flush=True)


def reshard_rounds(
    rank: int, world: int, points: list[dict[str, Any]], rounds: int
) -> list[dict[str, Any]]:
    """Cold loads of checkpoints saved by another world size into this one, ours and DCP
    alternating: for each of ``points`` (``spec``, ``kept`` paths, ``saved_sums`` from
    :func:`point_rounds`), ``rounds`` rounds, then the loaded values must match the saved
    sums. One untimed load per side first, at the first point. Rank 0 gets the samples."""
    out = []
    for index, saved in enumerate(points):
        started = time.monotonic()
        point = _Point(rank, world, "", saved["spec"], kept=saved["kept"])
        if index == 0:
            for side in SIDES:
                point.load(side, "kept", cold=False, timed=False)
        for i in range(rounds):
            for side in _order(i):
                point.load(side, "kept")
                if i == rounds - 1 and not same_sums(global_sums(point.state), saved["saved_sums"]):
                    raise RuntimeError(f"{side} load of {saved['spec']} into {world} ranks differs")
        out.append(
            {
                "spec": saved["spec"],
                "world": world,
                "times": point.times,
                "rank_rss_growth": dist_all_gather(point.rss),
                "rank_state_bytes": dist_all_gather(point.bytes),
            }
        )
        point.close()
        what = f"resharding load {index + 1}/{len(points)} ({_describe(saved['spec'])})"
        _said(rank, f"{what} into {world} ranks", started)
    return out if rank == 0 else []


def snapshot_rounds(
    rank: int, world: int, work: str, memory: str, widths: list[int], rounds: int
) -> list[dict[str, Any]]:
    """Curve 5's memory-tier stall: for each of ``widths`` (the FSDP2 MLP + AdamW), a
    ``CheckpointManager(memory_every=1)`` with each rank a node of its own (its memory
    directory under ``memory``), ``rounds`` + 1 snapshots (the first plans the layout, kept
    apart): barrier -> ``maybe_save`` -> the slowest rank's time in it (what training
    waits for), then the replication to the peer is awaited, untimed."""
    import torch.distributed as dist

    import ckpt

    out = []
    for width in widths:
        model, optim = build_trained(width)
        manager = ckpt.CheckpointManager(
            os.path.join(work, f"snapshots_{width}"),
            {"model": model, "optim": optim},
            memory_every=1,
            memory_dir=os.path.join(memory, f"node{rank}"),
            retention=None,
        )
        blocked = []
        for step in range(1, rounds + 2):
            dist.barrier()
            started = time.perf_counter()
            manager.maybe_save(step)
            took = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            blocked.append(float(took.item()))
            manager.tier("memory").memory.wait_replication()
            dist.barrier()
        state_bytes = dist_all_gather(local_tensor_bytes(sharded_state(model, optim)))
        manager.close()
        del manager, model, optim
        gc.collect()
        dist.barrier()  # both nodes' replications are over
        shutil.rmtree(os.path.join(memory, f"node{rank}"), ignore_errors=True)
        out.append({"width": width, "state_bytes": sum(state_bytes), "blocked_s": blocked})
    return out if rank == 0 else []
