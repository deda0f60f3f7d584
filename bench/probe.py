"""Where one measured call spends its time, and which collectives it makes: method
wrappers installed for the length of a ``with`` block, on the rank that measures.

Benchmark instrumentation only (the cost curves, :mod:`bench.curves`): a wrapper adds
the wall time of the outermost call of each phase (a subclass method calling its base's,
both wrapped, counts once) and restores every attribute on exit. Nothing here changes
what the wrapped code does.
"""

from __future__ import annotations

import functools
import pickle
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any


class _Patches:
    """Replace ``owner.attr`` with ``wrap(original)`` for each target; undo on exit."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def install(self, owner: Any, attr: str, wrapper: Callable[..., Any]) -> None:
        had_own = attr in vars(owner)
        original = vars(owner)[attr] if had_own else None
        setattr(owner, attr, wrapper)
        if had_own:
            self._undo.append(lambda: setattr(owner, attr, original))
        else:
            self._undo.append(lambda: delattr(owner, attr))

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


class _Probe:
    """A ``with`` block whose patches (installed by the subclass's ``__enter__``) are
    undone on exit."""

    def __init__(self) -> None:
        self._patches = _Patches()

    def __exit__(self, *exc: object) -> None:
        self._patches.restore()


class PhaseTimer(_Probe):
    """``seconds[phase]``: wall time inside the outermost calls of the phase's methods.

    ``phases`` maps a phase name to ``(class or module, attribute)`` pairs; a method
    reached again through a wrapped one of the same phase (``super()``) is not counted
    twice. ``calls[phase]`` counts those outermost calls.
    """

    def __init__(self, phases: dict[str, Iterable[tuple[Any, str]]]) -> None:
        super().__init__()
        self._phases = {name: list(targets) for name, targets in phases.items()}
        self.seconds: dict[str, float] = {name: 0.0 for name in self._phases}
        self.calls: dict[str, int] = {name: 0 for name in self._phases}
        self._depth = threading.local()

    def _wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, phase, 0)
            setattr(self._depth, phase, depth + 1)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self._depth, phase, depth)
                if depth == 0:
                    self.seconds[phase] += time.perf_counter() - started
                    self.calls[phase] += 1

        return timed

    def __enter__(self) -> PhaseTimer:
        for phase, targets in self._phases.items():
            for owner, attr in targets:
                self._patches.install(owner, attr, self._wrap(phase, getattr(owner, attr)))
        return self


OBJECT_COLLECTIVES = {
    # name -> how to find this rank's payload in the call's arguments
    "all_gather_object": lambda a, k: k.get("obj", a[1] if len(a) > 1 else None),
    "gather_object": lambda a, k: k.get("obj", a[0] if a else None),
    "broadcast_object_list": lambda a, k: k.get("object_list", a[0] if a else None),
    "scatter_object_list": lambda a, k: k.get(
        "scatter_object_input_list", a[1] if len(a) > 1 else None
    ),
}
"""Collectives of Python objects (pickled on the wire): the argument each rank sends."""
TENSOR_COLLECTIVES = {
    "all_reduce": 0,
    "broadcast": 0,
    "all_gather": 1,
    "all_gather_into_tensor": 1,
    "reduce_scatter": 1,
    "reduce_scatter_tensor": 1,
    "gather": 0,
    "scatter": 0,
    "send": 0,
    "recv": 0,
    "barrier": None,
}
"""Tensor collectives: the position of the tensor this rank sends (None: no payload)."""


def payload_bytes(value: Any) -> int:
    """Bytes a collective moves for ``value``: a tensor's, else its pickle's (None: 0)."""
    import torch

    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
        return sum(payload_bytes(v) for v in value)
    try:
        return len(pickle.dumps(value))
    except Exception:
        return 0


class CollectiveCounter(_Probe):
    """Count the ``torch.distributed`` collectives called inside the block, and the bytes
    this rank hands to each (a pickled object's size, a tensor's bytes).

    Only the outermost collective counts (``all_gather_object`` runs ``all_gather``
    inside). Payload sizes are computed by pickling, which costs time: count in a call
    that is not also timed. ``counts`` and ``bytes`` are keyed by collective name.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self._depth = threading.local()

    def _wrap(self, name: str, fn: Callable[..., Any], size: Callable[..., int]) -> Callable:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                self.counts[name] = self.counts.get(name, 0) + 1
                self.bytes[name] = self.bytes.get(name, 0) + size(args, kwargs)
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def __enter__(self) -> CollectiveCounter:
        import torch.distributed as dist

        for name, pick in OBJECT_COLLECTIVES.items():
            size = functools.partial(_object_size, name, pick)
            self._patches.install(dist, name, self._wrap(name, getattr(dist, name), size))
        for name, pos in TENSOR_COLLECTIVES.items():
            if not hasattr(dist, name):
                continue
            size = functools.partial(_tensor_size, pos)
            self._patches.install(dist, name, self._wrap(name, getattr(dist, name), size))
        return self

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def _object_size(name: str, pick: Callable[..., Any], args: tuple, kwargs: dict) -> int:
    value = pick(args, kwargs)
    lists = name in ("broadcast_object_list", "scatter_object_list")
    if lists and (value is None or all(v is None for v in value)):
        return 0  # the source's list is what travels; other ranks pass placeholders
    return payload_bytes(value)


def _tensor_size(pos: int | None, args: tuple, kwargs: dict) -> int:
    if pos is None:
        return 0
    value = args[pos] if len(args) > pos else kwargs.get("tensor", kwargs.get("input_tensor"))
    return payload_bytes(value)
