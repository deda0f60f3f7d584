"""A model the run keeps updating but did not put in the checkpoint state, said aloud.

The usual one is an EMA copy (``torch.optim.swa_utils.AveragedModel``, timm's
``ModelEmaV2``...) made with ``ema = AveragedModel(model)`` and updated every step: left
out of the manager's state it is not saved, and after a resume it starts again from the
resumed weights (``n_averaged`` back to 0), silently. Nothing links it to the registered
objects (it holds a deep copy), so rank 0 looks for it among the live modules: at the
first two saves, every ``nn.Module`` that is EMA-like (an ``n_averaged`` attribute, or
"ema"/"averaged"/"swa" in its class name) and is neither a registered module nor part of
one is fingerprinted; one whose fingerprint changed between the two saves is said at
WARNING with the fix. Two scans of the garbage collector's objects per run, on rank 0
(28 ms for the 285,000 objects of a process that imported torch and transformers, 136 ms
for 1.3 million), then never again.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

EMA_MARKS = ("ema", "averaged", "swa")
"""Parts of a class name (lower case) that mark an EMA-like module."""
SAVES_WATCHED = 2
"""Saves at which the live modules are fingerprinted (a change needs two)."""


def is_ema_like(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return hasattr(module, "n_averaged") or any(mark in name for mark in EMA_MARKS)


def unregistered_ema_modules(registered: Iterable[nn.Module]) -> list[nn.Module]:
    """Live EMA-like modules that are not registered and not inside a registered module
    (nor inside another such module)."""
    inside: set[int] = set()
    for module in registered:
        inside.update(id(m) for m in module.modules())
    found = [
        obj
        for obj in gc.get_objects()
        if issubclass(type(obj), nn.Module) and id(obj) not in inside and is_ema_like(obj)
    ]
    nested = {id(m) for obj in found for m in obj.modules() if m is not obj}
    return [obj for obj in found if id(obj) not in nested]


def fingerprint(module: nn.Module) -> tuple[Any, ...]:
    """Cheap: ``n_averaged`` when it has one, and a few values of each parameter."""
    counter = getattr(module, "n_averaged", None)
    values: list[float] = []
    with torch.no_grad():
        for param in module.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            flat = local.detach().reshape(-1)[:4]
            values.extend(float(v) for v in flat.float().cpu())
    count = int(counter) if isinstance(counter, torch.Tensor | int) else None
    return (count, tuple(values))


class UnregisteredModels:
    """Watches the first :data:`SAVES_WATCHED` saves (rank 0) for an EMA-like module that
    changes but is not in the state."""

    def __init__(self) -> None:
        self._first: dict[int, tuple[weakref.ref[nn.Module], tuple[Any, ...]]] | None = None
        self._done = False

    def observe(self, registered: Iterable[nn.Module]) -> list[str]:
        """Class names of the modules that changed since the first watched save (at the
        second one), else empty."""
        if self._done:
            return []
        current = {
            id(m): (weakref.ref(m), fingerprint(m))
            for m in unregistered_ema_modules(list(registered))
        }
        if self._first is None:
            self._first = current
            self._done = not current
            return []
        self._done = True
        changed = []
        for key, (ref, print_now) in current.items():
            before = self._first.get(key)
            module = ref()
            if before is not None and before[0]() is module and before[1] != print_now:
                changed.append(type(module).__name__)
        return changed
