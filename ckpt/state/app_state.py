"""From a user's dict of training objects to a checkpoint's state dict, and back.

``CheckpointManager`` takes one dict, e.g.
``{"model": model, "optim": optimizer, "sched": scheduler, "sampler": sampler, "epoch": 3}``.
Each value is one of:

- an ``nn.Module`` (FSDP2 or plain): saved through DCP's ``get_model_state_dict``
  (sharded DTensors, resharded on load), restored with ``set_model_state_dict``;
- a ``torch.optim.Optimizer``: ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``
  against the module in the same dict that owns its parameters;
- any ``Stateful`` (``state_dict()`` and ``load_state_dict()``: LR schedulers, samplers,
  your own objects): its state dict, which must be the same on every rank (DCP keeps
  one copy of a non-tensor item);
- a plain value (``int``, ``float``, ``str``, ``bool``, ``None``, tensors, lists and
  dicts of them): saved as is and put back into the dict on load (tensors are loaded
  in place, so a dict of tensors the script holds is updated);
- any of these wrapped in :class:`~ckpt.state.per_rank.PerRank`: its tensors are saved for
  each rank apart (plain tensors that differ across ranks are detected and saved per
  rank anyway, see :mod:`ckpt.state.per_rank`).

Tied parameters (one ``Parameter`` under two names) are stored once, under the first
name, and given back to the alias on load (:mod:`ckpt.format.names`); module tensors are named
as DCP names them, without a wrapper's prefix. An optimizer driven by an LR scheduler
that is not in the dict is found (:meth:`AppState.unsaved_schedulers`), and so are the
param-group values a load replaces (:func:`param_group_changes`).

Two traps are handled here. DCP's ``get_optimizer_state_dict`` on an optimizer that has
not stepped yet runs a zero-learning-rate ``step()`` to create its state, which sets
Adam's ``step`` counter: a save of such an optimizer records it as *fresh* and saves
nothing for it, and a load builds a template for it only when the checkpoint holds its
state. That zero step is also the slowest part of a resume in a new process (every op of
the step goes through DTensor's sharding propagation once per shape: about half of a
memory-tier resume of the bench's tiny GPT), so for ``torch.optim.Adam`` and ``AdamW``
the template's state is created here the way their first ``step()`` would (zeros, step
0; see :func:`init_adam_state`) and the step is not run; other optimizers take DCP's
path. Pure bookkeeping; no collectives except those inside DCP's state-dict helpers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from ckpt.errors import StateApplyError, StateSpecError
from ckpt.format import names
from ckpt.state.per_rank import PER_RANK_KEY, PerRank
from ckpt.state.rng import RNG_STATE_KEY

PLAIN_TYPES = (int, float, str, bool, type(None))


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` follows torch's ``Stateful`` protocol (``state_dict``/``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _is_plain(value: Any) -> bool:
    if isinstance(value, (*PLAIN_TYPES, torch.Tensor)):
        return True  # a tensor in a plain dict is loaded in place, so the dict stays yours
    if isinstance(value, list | tuple):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


@dataclass(slots=True)
class AppState:
    """The classified objects of one manager: modules, optimizers, Statefuls, plain values."""

    objects: dict[str, Any]
    modules: dict[str, torch.nn.Module] = field(default_factory=dict)
    optimizers: dict[str, tuple[torch.optim.Optimizer, torch.nn.Module]] = field(
        default_factory=dict
    )
    statefuls: dict[str, Any] = field(default_factory=dict)
    plain: list[str] = field(default_factory=list)
    per_rank: list[str] = field(default_factory=list)
    """Keys declared :class:`~ckpt.state.per_rank.PerRank`: every tensor under them is per rank."""
    aliases: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per module key, its tied parameters: ``{alias: stored name}`` (:mod:`ckpt.format.names`)."""

    @classmethod
    def classify(cls, objects: dict[str, Any]) -> AppState:
        """Sort ``objects`` by kind; raises :class:`StateSpecError` naming a bad key."""
        if not isinstance(objects, dict) or not objects:
            raise StateSpecError(
                "state must be a non-empty dict of name -> model, optimizer, scheduler, "
                f"Stateful or plain value, got {type(objects).__name__}"
            )
        unwrapped = {}
        declared = []
        for key, value in objects.items():
            if isinstance(value, PerRank):
                declared.append(key)
                value = value.obj
            unwrapped[key] = value
        app = cls(objects, per_rank=declared)
        for key, value in unwrapped.items():
            if not isinstance(key, str) or not key or "." in key or "/" in key:
                raise StateSpecError(f"state key {key!r}: use a non-empty str without '.' or '/'")
            if key in (RNG_STATE_KEY, PER_RANK_KEY):
                raise StateSpecError(
                    f"state key {key!r} is reserved for the per-rank state the manager saves"
                )
            if isinstance(value, torch.nn.Module):
                app.modules[key] = value
            elif isinstance(value, torch.optim.Optimizer):
                app.optimizers[key] = (value, None)  # type: ignore[assignment]
            elif is_stateful(value):
                app.statefuls[key] = value
            elif _is_plain(value):
                app.plain.append(key)
            else:
                raise StateSpecError(
                    f"state[{key!r}] is a {type(value).__name__}: give an nn.Module, an "
                    "optimizer, an object with state_dict()/load_state_dict(), or a plain "
                    "value (int, float, str, bool, None, tensors, lists/dicts of them)"
                )
        for key, (optim, _) in list(app.optimizers.items()):
            app.optimizers[key] = (optim, app._owner_of(key, optim))
        for key, module in app.modules.items():
            tied = names.tied_aliases(module)
            if tied:
                app.aliases[key] = tied
        return app

    def unsaved_schedulers(self) -> list[str]:
        """Keys of optimizers driven by an LR scheduler that is not in the state.

        Such a scheduler starts its schedule again (its warm-up) after every resume.
        torch marks the ``step`` of an optimizer a scheduler was built on
        (``_wrapped_by_lr_sched``); a scheduler in the state names it as ``.optimizer``.
        """
        saved = {id(getattr(obj, "optimizer", None)) for obj in self.statefuls.values()}
        return sorted(
            key
            for key, (optim, _) in self.optimizers.items()
            if getattr(optim.step, "_wrapped_by_lr_sched", False) and id(optim) not in saved
        )

    def _owner_of(self, key: str, optim: torch.optim.Optimizer) -> torch.nn.Module:
        wanted = {id(p) for group in optim.param_groups for p in group["params"]}
        for module in self.modules.values():
            if wanted & {id(p) for p in module.parameters()}:
                return module
        raise StateSpecError(
            f"state[{key!r}] optimizes parameters of no nn.Module in the state; add the model "
            "it trains to the same dict"
        )

    # -- save ----------------------------------------------------------------------------

    def fresh_optimizers(self) -> list[str]:
        """Keys of optimizers that have not stepped yet (no state to save)."""
        return sorted(key for key, (optim, _) in self.optimizers.items() if not optim.state)

    def state_dict(self, *, skip_optimizers: list[str] = ()) -> dict[str, Any]:  # type: ignore[assignment]
        """The checkpoint state (tensors by reference; DCP or staging copies them)."""
        out: dict[str, Any] = {}
        for key, module in self.modules.items():
            out[key] = get_model_state_dict(module)
            names.drop_aliases(out[key], self.aliases.get(key, {}))
        for key, (optim, owner) in self.optimizers.items():
            if key not in skip_optimizers:
                with _grads_set_aside(optim):
                    init_adam_state(optim)
                    out[key] = get_optimizer_state_dict(owner, optim)
        for key, obj in self.statefuls.items():
            out[key] = obj.state_dict()
        for key in self.plain:
            value = self.objects[key]
            out[key] = value.obj if isinstance(value, PerRank) else value
        return out

    # -- load ----------------------------------------------------------------------------

    def load(self, loaded: dict[str, Any], *, skip_optimizers: list[str] = ()) -> None:  # type: ignore[assignment]
        """Push a loaded state (the template after ``ckpt.load``) back into the objects.

        Raises :class:`~ckpt.errors.StateApplyError` naming the state key whose object
        refused its values (what it raised is the cause)."""
        for key, module in self.modules.items():
            with _applying(key):
                names.restore_aliases(loaded[key], self.aliases.get(key, {}))
                set_model_state_dict(module, loaded[key])
        for key, (optim, owner) in self.optimizers.items():
            if key not in skip_optimizers:
                with _applying(key), _grads_set_aside(optim):
                    set_optimizer_state_dict(owner, optim, loaded[key])
        for key, obj in self.statefuls.items():
            with _applying(key):
                obj.load_state_dict(loaded[key])
        for key in self.plain:
            if isinstance(self.objects[key], PerRank):
                self.objects[key].obj = loaded[key]
            else:
                self.objects[key] = loaded[key]

    # -- descriptions ------------------------------------------------------------------

    def fill_parameters(self, value: float) -> list[str]:
        """Set this rank's part of every floating parameter of the modules to ``value`` (a
        fault drill: NaN); the parameters' names."""
        filled = []
        with torch.no_grad():
            for key, module in self.modules.items():
                for name, param in module.named_parameters():
                    local = param.to_local() if isinstance(param, DTensor) else param
                    if local.dtype.is_floating_point and local.numel():
                        local.fill_(value)
                        filled.append(f"{key}.{name}")
        return filled

    def tensor_shapes(self) -> dict[str, dict[str, list[int]]]:
        """Global shape of every module tensor, by state key and DCP name (shape checks)."""
        return {key: names.canonical_shapes(module) for key, module in self.modules.items()}

    def canonical_shapes(
        self, saved: dict[str, dict[str, list[int]]]
    ) -> dict[str, dict[str, list[int]]]:
        """A checkpoint's shape record under the names :meth:`tensor_shapes` uses."""
        return {
            key: names.canonical_record(self.modules[key], shapes)
            if key in self.modules and isinstance(shapes, dict)
            else shapes
            for key, shapes in saved.items()
        }

    def param_groups(self) -> dict[str, list[dict[str, Any]]]:
        """Every optimizer's param-group values (all but ``params``), copied."""
        return {
            key: [{k: _plain(v) for k, v in g.items() if k != "params"} for g in optim.param_groups]
            for key, (optim, _) in self.optimizers.items()
        }

    def keep_param_groups(self, constructed: dict[str, list[dict[str, Any]]]) -> None:
        """Put the constructed param-group values back after a load (``param_groups=
        "constructed"``).

        A scheduler-driven group (it has ``initial_lr``) keeps the checkpoint's place in
        the schedule: its ``lr`` is scaled by new / old ``initial_lr`` and the
        schedulers in the state that drive the optimizer get the new base lr (exact for
        schedulers computed from their base lrs, such as ``LambdaLR``, which
        ``transformers``' ``get_*_schedule_with_warmup`` return).
        """
        for key, groups in constructed.items():
            optim = self.optimizers[key][0]
            for index, (mine, group) in enumerate(zip(groups, optim.param_groups)):
                old_base = group.get("initial_lr")
                for name, value in mine.items():
                    if name == "lr" and "initial_lr" in mine:
                        continue
                    current = group.get(name)
                    if isinstance(current, torch.Tensor):
                        current.copy_(torch.as_tensor(value, dtype=current.dtype))
                    else:
                        group[name] = tuple(value) if isinstance(current, tuple) else value
                new_base = mine.get("initial_lr")
                if new_base is not None and old_base and float(old_base) != float(new_base):
                    group["lr"] = float(group["lr"]) * float(new_base) / float(old_base)
                    for obj in self.statefuls.values():
                        if getattr(obj, "optimizer", None) is optim:
                            _set_base_lr(obj, index, float(new_base))
            for obj in self.statefuls.values():
                if getattr(obj, "optimizer", None) is optim and hasattr(obj, "_last_lr"):
                    obj._last_lr = [g["lr"] for g in optim.param_groups]

    def local_bytes(self) -> int:
        """Bytes of tensor data this rank holds for the state (for save-time estimates)."""
        total = 0
        for module in self.modules.values():
            for t in module.state_dict().values():
                total += _local_nbytes(t)
        for optim, _ in self.optimizers.values():
            for per_param in optim.state.values():
                for value in per_param.values():
                    total += _local_nbytes(value)
        return total


def _plain(value: Any) -> Any:
    """A param-group value comparable with ``==`` (tensors as numbers, tuples as lists)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _set_base_lr(scheduler: Any, index: int, lr: float) -> None:
    """Set group ``index``'s base lr of a scheduler and of the ones it chains (SequentialLR)."""
    base = getattr(scheduler, "base_lrs", None)
    if isinstance(base, list) and index < len(base):
        base[index] = lr
    for inner in getattr(scheduler, "_schedulers", []) or []:
        _set_base_lr(inner, index, lr)


def param_group_changes(
    constructed: dict[str, list[dict[str, Any]]], loaded: dict[str, list[dict[str, Any]]]
) -> list[str]:
    """The param-group values a load replaced: ``"optim group 0: lr 0.003 -> 0.002"``. Pure.

    ``lr`` of a scheduler-driven group (it has ``initial_lr``) is the scheduler's place
    in its schedule, not a setting: its ``initial_lr`` is compared instead.
    """
    out = []
    for key, groups in constructed.items():
        for index, (mine, theirs) in enumerate(zip(groups, loaded.get(key, []))):
            for name, value in mine.items():
                if name == "lr" and "initial_lr" in mine:
                    continue
                if name in theirs and theirs[name] != value:
                    out.append(
                        f"{key} group {index}: {name} {value!r} (constructed) -> "
                        f"{theirs[name]!r} (checkpoint)"
                    )
    return out


def _scalar_dtype(fused: bool) -> torch.dtype:
    if fused or torch.get_default_dtype() != torch.float64:
        return torch.float32
    return torch.float64


def _zeros_like(param: torch.Tensor) -> torch.Tensor:
    """Zeros shaped and placed like ``param``; a DTensor's built from its local shard, so no
    op goes through DTensor's dispatch."""
    if isinstance(param, DTensor):
        with torch.no_grad():
            local = param.to_local()
        return DTensor.from_local(
            torch.zeros_like(local, memory_format=torch.preserve_format),
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return torch.zeros_like(param, memory_format=torch.preserve_format)


@contextlib.contextmanager
def _grads_set_aside(optim: torch.optim.Optimizer) -> Iterator[None]:
    """The optimizer's parameters without their ``.grad`` inside, as they were after.

    A never-stepped optimizer whose parameters hold gradients (a backward pass before the
    resume, a second ``fit`` in one process) gets no state from :func:`init_adam_state`
    nor from DCP's zero step, which both leave such an optimizer alone: its template then
    has no state entries and a load silently drops the checkpoint's. With the gradients
    out of the way the state is built, and the gradients come back untouched.
    """
    params = [p for group in optim.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    if all(g is None for g in grads):
        yield
        return
    for param in params:
        param.grad = None
    try:
        yield
    finally:
        for param, grad in zip(params, grads):
            param.grad = grad


def _adam_state_of(cls: type) -> bool:
    """Whether optimizers of ``cls`` create exactly Adam's state in their first step."""
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        return True
    if not issubclass(cls, torch.optim.Adam) or getattr(cls, "ckpt_adam_state", False) is not True:
        return False
    # Whose _init_group it runs: torch's own classes (whose attribute torch._dynamo may
    # have rewrapped, class by class), not one of its own.
    owner = next(k for k in cls.__mro__ if "_init_group" in vars(k))
    return owner in (torch.optim.Adam, torch.optim.AdamW)


def init_adam_state(optim: torch.optim.Optimizer) -> bool:
    """Give a never-stepped ``Adam``/``AdamW`` the state its first ``step()`` creates.

    The same entries as ``Adam._init_group`` (``step`` 0 on the CPU, or on the parameter's
    device when ``fused`` or ``capturable``; ``exp_avg``, ``exp_avg_sq`` and with
    ``amsgrad`` ``max_exp_avg_sq`` as zeros like the parameter) for every parameter that
    requires grad, so the next ``step()`` runs as the first one would. Returns False and
    changes nothing for another optimizer type (a subclass too, unless it declares
    ``ckpt_adam_state = True`` and keeps Adam's ``_init_group``: its state is Adam's), an
    optimizer with state or gradients already, or a ``differentiable`` one: DCP's zero
    step applies.
    """
    if optim.state or not _adam_state_of(type(optim)):
        return False
    groups = optim.param_groups
    if any(g.get("differentiable") for g in groups):
        return False
    if any(p.grad is not None for g in groups for p in g["params"]):
        return False
    for group in groups:
        fused, capturable = bool(group.get("fused")), bool(group.get("capturable"))
        for param in group["params"]:
            if not param.requires_grad:
                continue
            state = optim.state[param]
            if fused or capturable:
                state["step"] = torch.zeros((), dtype=_scalar_dtype(fused), device=param.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype(False), device="cpu")
            state["exp_avg"] = _zeros_like(param)
            state["exp_avg_sq"] = _zeros_like(param)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = _zeros_like(param)
    return True


def _local_nbytes(value: Any) -> int:
    if isinstance(value, DTensor):
        value = value._local_tensor
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0


def shape_mismatch(
    expected: dict[str, dict[str, list[int]]], saved: dict[str, dict[str, list[int]]]
) -> str | None:
    """Describe the first tensor whose shape differs (or that one side lacks), else None."""
    for key, shapes in expected.items():
        theirs = saved.get(key)
        if theirs is None:
            continue  # an older checkpoint without this record: DCP's own checks apply
        for name, shape in shapes.items():
            if name not in theirs:
                return f"tensor {name!r} (shape {shape}) is missing from the checkpoint"
            if list(theirs[name]) != shape:
                return (
                    f"tensor {name!r} has shape {list(theirs[name])} in the checkpoint but "
                    f"{shape} in this model"
                )
        for name, shape in theirs.items():
            if name not in shapes:
                return f"the checkpoint has tensor {name!r} (shape {list(shape)}) that this model lacks"
    return None


@contextlib.contextmanager
def _applying(key: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        raise StateApplyError(
            f"state {key!r} refused the checkpoint's values: {type(exc).__name__}: {exc}",
            key=key,
        ) from exc
