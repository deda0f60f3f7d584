"""Replicated state read once: items every rank loads are fetched by one rank and broadcast.

Under DDP (and for the replicated values of any model: optimizer step counters, extra
state) every rank loads the same stored items; read as usual, each of N ranks fetches
them from storage, N times the bytes, requests and egress. Here the load's coordinator,
which sees every rank's plan, picks the items *every* rank loads, cuts them into spans
(the reader's span size, no gaps), and gives each span one reader, the rank with the
fewest bytes assigned so far. The plan travels in each ``LoadPlan.storage_data``
(:class:`SharedReads`, identical on every rank), so every rank walks the same spans in the
same order: the reader fetches its spans ahead (two in flight) and broadcasts each over
the checkpoint group, a status byte in front; every rank, the reader too, checks each
item's crc32c against the manifest before using it, so a broadcast byte is trusted no
more than a read one.

A rank that fails (a read, a mismatch) keeps taking part in every broadcast and raises
once the spans are done, so no rank is left waiting in a collective; a failed read is a
status byte of 0, which every other rank turns into an error naming the reader.

Items only some ranks load (a resharded FSDP shard, the replicated dimension of a 2-D
mesh) are read by each rank as before. Only on a gloo group (CPU tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ckpt.errors import CheckpointUnreadableError

Span = tuple[str, int, int, int]
"""``(path, start, end, reader rank)``: bytes ``[start, end)`` of ``path``."""
PREFETCH = 2
"""Spans a reader fetches ahead of the broadcast it is in."""


@dataclass(frozen=True, slots=True)
class SharedReads:
    """The spans of items every rank loads, in the order every rank broadcasts them."""

    spans: tuple[Span, ...]
    members: frozenset[tuple[str, int]]
    """``(path, offset)`` of every stored item inside the spans."""


def usable(group: Any) -> bool:
    """Whether broadcasts of CPU tensors can run on ``group`` (a gloo group of 2+ ranks)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return False
    try:
        return dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1
    except (RuntimeError, ValueError):
        return False


def plan_shared_reads(
    plans: list[Any],
    extent_of: Callable[[Any], tuple[str, int, int]],
    coalesce: Callable[[list[tuple[int, int]]], list[tuple[int, int, list[int]]]],
) -> SharedReads | None:
    """The shared spans of ``plans`` (one per rank, in rank order), or ``None`` when no
    stored item is loaded by every rank. ``extent_of(read_item)`` is the stored item's
    ``(path, offset, length)``; ``coalesce`` groups one file's sorted extents. Pure."""
    if len(plans) < 2:
        return None
    counts: dict[tuple[str, int, int], int] = {}
    for plan in plans:
        for extent in {extent_of(item) for item in plan.items}:
            counts[extent] = counts.get(extent, 0) + 1
    everyone = sorted(e for e, n in counts.items() if n == len(plans))
    if not everyone:
        return None
    per_file: dict[str, list[tuple[int, int]]] = {}
    for path, offset, length in everyone:
        per_file.setdefault(path, []).append((offset, length))
    assigned = [0] * len(plans)
    spans: list[Span] = []
    for path in sorted(per_file):
        for start, end, _members in coalesce(per_file[path]):
            reader = min(range(len(plans)), key=lambda r: (assigned[r], r))
            assigned[reader] += end - start
            spans.append((path, start, end, reader))
    members = frozenset((path, offset) for path, offset, _ in everyone)
    return SharedReads(spans=tuple(spans), members=members)


def exchange(
    shared: SharedReads,
    items: list[Any],
    offset_of: Callable[[Any], tuple[str, int]],
    *,
    group: Any,
    rank: int,
    read_into: Callable[[str, int, memoryview], None],
    use: Callable[[str, int, memoryview, list[Any]], None],
    url: str,
    failed: BaseException | None = None,
) -> int:
    """Walk ``shared.spans`` with every rank of ``group``: read this rank's spans
    (``read_into(path, start, view)``), broadcast every span from its reader, and
    ``use(path, start, view, items)`` each with this rank's ``items`` inside it. Returns
    the bytes this rank read from storage. ``failed``: an error this rank already has
    (it still takes part, uses nothing, and raises it at the end)."""
    by_span: dict[int, list[Any]] = {}
    spans_of_path: dict[str, list[int]] = {}
    for index, (path, *_rest) in enumerate(shared.spans):
        spans_of_path.setdefault(path, []).append(index)
    for item in items:
        path, offset = offset_of(item)
        for index in spans_of_path.get(path, ()):
            _, start, end, _ = shared.spans[index]
            if start <= offset < end:
                by_span.setdefault(index, []).append(item)
                break
    mine = [i for i, span in enumerate(shared.spans) if span[3] == rank]
    error = failed
    read = 0

    def fetch(index: int) -> torch.Tensor:
        path, start, end, _ = shared.spans[index]
        buf = torch.empty(end - start + 1, dtype=torch.uint8)
        read_into(path, start, memoryview(buf.numpy())[1:])
        buf[0] = 1
        return buf

    with ThreadPoolExecutor(max_workers=PREFETCH, thread_name_prefix="ckpt-read-once") as pool:
        ahead: dict[int, Future[torch.Tensor]] = {}
        queue = iter(mine)

        def top_up() -> None:
            while len(ahead) < PREFETCH:
                nxt = next(queue, None)
                if nxt is None:
                    return
                ahead[nxt] = pool.submit(fetch, nxt)

        top_up()
        for index, (path, start, end, reader) in enumerate(shared.spans):
            if reader == rank:
                try:
                    buf = ahead.pop(index).result()
                    read += end - start
                except Exception as exc:  # told to the others by the status byte
                    buf = torch.zeros(end - start + 1, dtype=torch.uint8)
                    error = error or exc
                top_up()
            else:
                buf = torch.empty(end - start + 1, dtype=torch.uint8)
            dist.broadcast(buf, src=dist.get_global_rank(group, reader), group=group)
            if error is not None:
                continue
            if int(buf[0]) != 1:
                error = CheckpointUnreadableError(
                    f"{url}: rank {reader} could not read {path} bytes [{start}, {end}) that "
                    "every rank loads (its own error says why)",
                    url=url,
                    path=path,
                )
                continue
            members = by_span.get(index)
            if members:
                try:
                    use(path, start, memoryview(buf.numpy())[1:], members)
                except Exception as exc:
                    error = exc
    if error is not None:
        raise error
    return read
