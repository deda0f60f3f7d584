"""``CheckpointOptions``: every setting of a :class:`~ckpt.manager.CheckpointManager`, in one
documented dataclass validated in one place.

A script passes it as ``CheckpointManager(root, state, options=CheckpointOptions(...))``;
the manager's keyword arguments (``every=50, async_save=True``) build the same object
(:meth:`CheckpointOptions.from_kwargs`). The trainer's ``[checkpoint]`` section
(``trainer/config.py``, ``CheckpointConfig``) is a subclass: its keys, defaults and checks
are these, plus the trainer's own (``dir``, ``resume``) and its ``every`` default.

What describes the state rather than how it is checkpointed stays with the manager's
other arguments: ``rng``/``seed`` (the state's RNG and how it is re-derived),
``metadata``, ``on_event``, ``storage_options``, ``process_group``, ``tiers``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from ckpt.env import MAX_LEASE_TTL_S
from ckpt.root.retention import DEFAULT_RETENTION, RetentionPolicy
from ckpt.saving import finite
from ckpt.saving.policy import AnyOf, EveryNSteps, EverySeconds, SaveDecisionPolicy

MAX_EVERY_S = 7 * 86400.0
"""The longest ``every_s``: a week."""
PARAM_GROUPS = ("checkpoint", "constructed")
"""``param_groups``: whose optimizer settings a resume keeps."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointOptions:
    """How a :class:`~ckpt.manager.CheckpointManager` saves, keeps and resumes checkpoints.

    Frozen; invalid values raise ``ValueError`` naming the field and the value. ``None``
    for a field read from the environment means: the variable, else its default.
    """

    every: int = 0
    """Durable save every N steps (``maybe_save``); 0: only at ``final``."""
    every_s: float = 0.0
    """Durable save also once this many seconds passed since the last one (0: not by the
    clock); decided on rank 0 and broadcast, so every rank saves at the same step."""
    policy: SaveDecisionPolicy | None = None
    """The durable tier's save-decision policy, replacing ``every``/``every_s`` (a small
    class with ``should_save(step, *, final, context)``: :mod:`ckpt.saving.policy`)."""
    async_save: bool = False
    """Periodic durable saves return once the state is staged in host memory; the copy
    overlaps the next steps (one save in flight). Final and emergency saves are synchronous."""
    keep_last: int = DEFAULT_RETENTION.keep_last
    """Retention: keep the newest N committed checkpoints after each commit (the one resumed
    from survives until a newer commit); 0 keeps every checkpoint."""
    keep_every: int = 0
    """Retention: also keep, forever, committed checkpoints whose step is a multiple of N
    (0: none)."""
    max_failures: int = 3
    """Stop (``TooManySaveFailuresError``, every rank at the same step) after this many
    durable saves failed in a row; 0 never stops. A failed final save always stops."""
    memory_every: int = 0
    """Memory tier: also snapshot every N steps into node memory, replicated to another node;
    a resume prefers the newest complete snapshot newer than the durable head. 0: off."""
    memory_dir: str | None = None
    """The memory tier's node-local directory (None: ``CKPT_MEMORY_DIR``, else
    ``/dev/shm/ckpt-memory-<uid>``)."""
    param_groups: str = "checkpoint"
    """Optimizer settings after a resume: ``"checkpoint"`` (the saved ones, as torch's
    ``load_state_dict``; the changes are said at WARNING) or ``"constructed"`` (the ones the
    optimizer was built with)."""
    allow_non_finite: bool | tuple[str, ...] = False
    """Keys whose NaN or inf values do not refuse a save or snapshot: True, or fnmatch
    patterns such as ``("model.*.mask",)``."""
    setup_timeout_s: float | None = None
    """Seconds a rank waits for the others while the manager's gloo group is created (None:
    ``CKPT_COLLECTIVE_TIMEOUT_S``, 600 s)."""
    lease_ttl_s: float | None = None
    """Seconds the root's owner lease lives without renewal (None: ``CKPT_LEASE_TTL_S``,
    else 60; 0: no lease)."""

    _key_prefix: ClassVar[str] = ""
    """Put before a field's name in errors (the trainer's section: ``config checkpoint.``)."""

    def __post_init__(self) -> None:
        for name in ("every", "keep_last", "keep_every", "max_failures", "memory_every"):
            value = getattr(self, name)
            self._require(
                not isinstance(value, bool) and isinstance(value, int) and value >= 0,
                name,
                value,
                _WHY_COUNT[name],
            )
        self._require(isinstance(self.async_save, bool), "async_save", self.async_save,
                      "must be true or false")  # fmt: skip
        self._require(
            not isinstance(self.every_s, bool)
            and isinstance(self.every_s, int | float)
            and math.isfinite(self.every_s)
            and 0 <= self.every_s <= MAX_EVERY_S,
            "every_s",
            self.every_s,
            f"must be seconds in [0, {MAX_EVERY_S:.0f}] (0: not by the clock)",
        )
        self._require(
            self.policy is None or callable(getattr(self.policy, "should_save", None)),
            "policy",
            self.policy,
            "must have should_save(step, *, final, context) (ckpt.saving.policy), or be None",
        )
        self._require(
            self.memory_dir is None or (isinstance(self.memory_dir, str) and self.memory_dir),
            "memory_dir",
            self.memory_dir,
            "must be a non-empty path, or None for CKPT_MEMORY_DIR",
        )
        self._require(self.param_groups in PARAM_GROUPS, "param_groups", self.param_groups,
                      f"must be one of {', '.join(PARAM_GROUPS)}")  # fmt: skip
        try:
            allow = finite.check_allow(self.allow_non_finite)
        except ValueError as exc:
            raise ValueError(
                f"{self._key_prefix}allow_non_finite={self.allow_non_finite!r}: {exc}"
            ) from None
        object.__setattr__(self, "allow_non_finite", allow)  # a list becomes a tuple
        self._require(
            self.setup_timeout_s is None or _seconds(self.setup_timeout_s) > 0,
            "setup_timeout_s",
            self.setup_timeout_s,
            "must be seconds > 0, or None for CKPT_COLLECTIVE_TIMEOUT_S",
        )
        self._require(
            self.lease_ttl_s is None or 0 <= _seconds(self.lease_ttl_s) <= MAX_LEASE_TTL_S,
            "lease_ttl_s",
            self.lease_ttl_s,
            f"must be seconds in [0, {MAX_LEASE_TTL_S:.0f}] (0: no lease), or None for "
            "CKPT_LEASE_TTL_S",
        )

    def _require(self, ok: bool, name: str, value: object, why: str) -> None:
        if not ok:
            raise ValueError(f"{self._key_prefix}{name}={value!r}: {why}")

    def durable_policy(self) -> SaveDecisionPolicy:
        """When the durable tier saves: ``policy``, else every ``every`` steps and/or
        ``every_s`` seconds, and at ``final``."""
        if self.policy is not None:
            return self.policy
        steps = EveryNSteps(self.every)
        if not self.every_s:
            return steps
        return AnyOf((steps, EverySeconds(float(self.every_s))))

    @property
    def saves_periodically(self) -> bool:
        """Some tier saves before ``final``: by steps, by the clock, by a policy of the
        user's own (assumed to), or to the memory tier."""
        return bool(self.every or self.every_s or self.policy is not None or self.memory_every)

    def retention(self) -> RetentionPolicy | None:
        """``keep_last``/``keep_every`` as the policy applied after each commit (None: keep all)."""
        if self.keep_last == 0:
            return None
        return RetentionPolicy(keep_last=self.keep_last, keep_every=self.keep_every or None)

    def options(self) -> CheckpointOptions:
        """These options as a plain :class:`CheckpointOptions` (a subclass drops its own fields)."""
        if type(self) is CheckpointOptions:
            return self
        return CheckpointOptions(
            **{f.name: getattr(self, f.name) for f in fields(CheckpointOptions)}
        )

    @classmethod
    def resolve(cls, options: object, kwargs: dict[str, Any]) -> CheckpointOptions:
        """A manager's ``options=`` or its keyword arguments (not both), as its options."""
        if options is None:
            options = cls.from_kwargs(**kwargs)
        elif not isinstance(options, CheckpointOptions):
            raise ValueError(f"options must be a ckpt.CheckpointOptions, got {options!r}")
        elif kwargs:
            raise ValueError(
                f"options= and the keyword argument(s) {', '.join(sorted(kwargs))} both "
                "given: put every setting in the CheckpointOptions"
            )
        return options.options()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> CheckpointOptions:
        """The options of ``CheckpointManager``'s keyword arguments (``every=50, ...``).

        The field names, plus ``retention``: a :class:`~ckpt.root.retention.RetentionPolicy`
        (its ``keep_last``/``keep_every``) or None (keep every checkpoint).
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known - {"retention"})
        if unknown:
            raise TypeError(
                f"CheckpointManager() got unexpected keyword argument(s) {', '.join(unknown)}; "
                f"its options are {', '.join(sorted(known | {'retention'}))}"
            )
        if "retention" in kwargs:
            kwargs.update(_retention_fields(kwargs.pop("retention")))
        return cls(**kwargs)


_WHY_COUNT = {
    "every": "must be an int >= 0 (0: save only at the end)",
    "keep_last": "must be an int >= 0 (0 keeps every checkpoint)",
    "keep_every": "must be an int >= 0 (0: no step kept forever)",
    "max_failures": "must be an int >= 0 (0: never stop for failed saves)",
    "memory_every": "must be an int >= 0 (0: no memory tier)",
}


def _seconds(value: object) -> float:
    """``value`` as finite seconds, else NaN (which fails every range check)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value) if math.isfinite(value) else math.nan


def _retention_fields(policy: object) -> dict[str, int]:
    """``retention=`` of the manager's keyword arguments as ``keep_last``/``keep_every``."""
    if policy is None:
        return {"keep_last": 0, "keep_every": 0}
    if not isinstance(policy, RetentionPolicy):
        raise ValueError(
            f"retention={policy!r}: must be a ckpt.RetentionPolicy or None (keep every checkpoint)"
        )
    if not policy.delete_partial or policy.protect or policy.dead_runs:
        raise ValueError(
            f"retention={policy!r}: a manager's retention is keep_last and keep_every only "
            "(it protects the checkpoint it resumed from and clears dead attempts itself)"
        )
    return {"keep_last": policy.keep_last, "keep_every": policy.keep_every or 0}


def option_view(name: str) -> property:
    """A read-only attribute that reads ``self.options.<name>`` (the manager's ``every``,
    ``async_save``, ... as they were before the options object)."""
    return property(
        lambda self: getattr(self.options, name), doc=f"``options.{name}`` (read-only)."
    )
