"""Save-time check of a state: what a save commits must be what a resume can load back.

A resume decodes every non-tensor value with ``torch.load(weights_only=True)`` (never
running code from a checkpoint), which refuses anything but plain data. A value it
refuses (a numpy scalar, an arbitrary object) would commit, verify, and then fail
every resume. :func:`checked_state` therefore walks the state before any byte is
written and

- converts what converts exactly: a numpy scalar to the Python number of the same value,
  a numeric numpy array to a tensor sharing its memory (a resume whose state holds the
  same numpy scalar type or array there gets them back: :class:`LoadableState`);
- refuses anything else with :class:`~ckpt.errors.UnsupportedStateError` naming the key
  and the type, on the calling rank, before anything is written.

Top-level ``Stateful`` objects are resolved here (``state_dict()`` once), as DCP would.
"""

from __future__ import annotations

import collections
from collections.abc import Collection
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import _init_optim_state

from ckpt.errors import UnsupportedStateError
from ckpt.state.app_state import init_adam_state

_PLAIN = (bool, int, float, complex, str, bytes, bytearray, torch.Size, torch.dtype, torch.device)
"""Leaf values ``torch.load(weights_only=True)`` reads back (checked for torch 2.13)."""


def checked_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as a save writes it (module docstring); raises :class:`UnsupportedStateError`.

    The containers are new; tensors are the caller's (by reference, as before).
    """
    out: dict[str, Any] = {}
    for key, value in state.items():
        if _is_stateful(value) and not isinstance(value, torch.Tensor):
            value = value.state_dict()
        out[key] = _checked(value, str(key))
    return out


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _checked(value: Any, path: str) -> Any:
    if value is None or isinstance(value, (torch.Tensor, *_PLAIN)):
        return value
    if isinstance(value, dict):  # a load fills the template's own containers: keep values
        kind = collections.OrderedDict if isinstance(value, collections.OrderedDict) else dict
        return kind((k, _checked(v, f"{path}.{k}")) for k, v in value.items())
    if isinstance(value, list | tuple):
        items = [_checked(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, set):
        return {_checked(v, f"{path}{{...}}") for v in value}
    if isinstance(value, np.generic):
        plain = value.item()
        if isinstance(plain, _PLAIN):
            return plain
    if isinstance(value, np.ndarray):
        try:
            return torch.from_numpy(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise UnsupportedStateError(
                f"state[{path}] is a numpy array of dtype {value.dtype} that has no exact "
                f"tensor form ({exc}); save it as a tensor or a list"
            ) from None
    raise UnsupportedStateError(
        f"state[{path}] is a {type(value).__module__}.{type(value).__qualname__}, which a "
        "resume cannot load back (values are read as plain data: tensors, numbers, strings, "
        "bytes, None and lists, tuples, sets and dicts of them). Convert it, or wrap it in "
        "an object with state_dict()/load_state_dict() that returns such values."
    )


class LoadableState:
    """A state to load as DCP can take it, and :meth:`finish` to give the values back.

    DCP's load drops numpy values from the state it loads into (they are not tensors).
    Here they are swapped, in place, for what a save wrote them as: a numpy array for a
    tensor viewing its memory (the load fills the array itself), a numpy scalar for the
    Python number of its value. Top-level ``Stateful`` objects are resolved first
    (``state_dict()``), as DCP would. :meth:`finish`, after a successful load, puts the
    numpy objects back (scalars of the same numpy type, now holding the loaded value),
    calls ``load_state_dict`` of each Stateful and sets the other top-level values into
    the caller's dict, as DCP does.

    An optimizer's ``state_dict()`` holds no per-parameter state before its first
    ``step()``, so a fresh optimizer would take nothing from a checkpoint:
    :meth:`make_room` gives it that state first, and :meth:`not_loaded` names what
    still has no place in the state.
    """

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.plain: dict[str, Any] = {}
        self._statefuls: dict[str, Any] = {}
        self._swapped: list[tuple[Any, Any, Any]] = []
        for key, value in state.items():
            if _is_stateful(value) and not isinstance(value, torch.Tensor):
                self._statefuls[key] = value
                value = value.state_dict()
            self.plain[key] = value
        self._swap(self.plain)

    def make_room(self, stored: Collection[str]) -> None:
        """Give each never-stepped optimizer passed as an object the state its first
        ``step()`` creates, when the checkpoint (``stored``: its flattened keys) holds
        state for it; the manager's templates do the same (:mod:`ckpt.state.app_state`).

        ``Adam``/``AdamW`` get zeros and step 0 (:func:`~ckpt.state.app_state.init_adam_state`);
        another optimizer takes DCP's zero-learning-rate ``step()``. An optimizer the
        checkpoint saved fresh (no ``KEY.state.*``) is left alone: a template with state
        would ask the checkpoint for keys it does not have.
        """
        for key, obj in self._statefuls.items():
            if not isinstance(obj, torch.optim.Optimizer) or obj.state:
                continue
            prefix = f"{key}.state."
            if not any(name.startswith(prefix) for name in stored):
                continue
            if not init_adam_state(obj):
                _init_optim_state(obj)
            if obj.state:
                self.plain[key] = obj.state_dict()
                self._swap(self.plain[key])

    def not_loaded(self, stored: Collection[str]) -> list[str]:
        """Keys of ``stored`` (a checkpoint's flattened keys) under a top-level key of the
        state that the state has no place for: a load leaves them in the checkpoint.

        Top-level keys the state does not have at all are not listed (loading part of a
        checkpoint is allowed).
        """
        flat, _ = flatten_state_dict(self.plain)
        tops = {str(key) for key in self.plain}
        return sorted(
            name
            for name in stored
            if name not in flat and any(name == top or name.startswith(f"{top}.") for top in tops)
        )

    def _swap(self, container: dict[Any, Any] | list[Any]) -> None:
        keys = container.keys() if isinstance(container, dict) else range(len(container))
        for key in list(keys):
            value = container[key]
            if isinstance(value, np.ndarray):
                if not value.flags.writeable:
                    raise UnsupportedStateError(
                        f"state[{key}]: a numpy array to load into is read-only"
                    )
                container[key] = torch.from_numpy(value)
            elif isinstance(value, np.generic) and isinstance(
                value.item(), bool | int | float | complex
            ):
                container[key] = value.item()
            elif isinstance(value, dict | list):
                self._swap(value)
                continue
            else:
                continue
            self._swapped.append((container, key, value))

    def finish(self) -> None:
        """After a successful load: the loaded values where the caller's state holds them."""
        for container, key, original in reversed(self._swapped):
            if isinstance(original, np.generic):
                loaded = container[key]
                container[key] = (
                    type(original)(loaded) if not isinstance(loaded, torch.Tensor) else loaded
                )
            else:
                container[key] = original  # an array, filled through the view
        for key, value in self.plain.items():
            if key in self._statefuls:
                self._statefuls[key].load_state_dict(value)
            else:
                self.state[key] = value
