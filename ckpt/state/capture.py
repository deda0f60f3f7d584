"""What a :class:`~ckpt.manager.CheckpointManager` saves and how a resume maps it back.

:class:`StateCapture` turns the manager's state objects (:class:`~ckpt.state.app_state.AppState`)
into the state dict and manifest record of one step, and keeps what must carry from
save to save: the models' shapes (the shape check on resume), the per-rank tensor
paths (:mod:`ckpt.state.per_rank`: detected by comparing across ranks, or declared) and each
sampler's last data position (the guard against a forgotten ``sampler.advance()``).
The record also names tied parameters (``tied``: stored once, :mod:`ckpt.format.names`) and a
``transformers`` model's config (``hf``, :mod:`ckpt.state.hf`). At the first save it says at
WARNING when a data position moved that is in no manager's state (``runcore.positions``).
The manager decides when to save; this decides what.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ckpt import dist as _dist
from ckpt.errors import DataPositionError
from ckpt.format.manager_record import RECORD_KEY
from ckpt.state import per_rank
from ckpt.state.app_state import AppState
from ckpt.state.hf import HF_RECORD_KEY, pretrained_record
from ckpt.state.rng import RNG_STATE_KEY, capture_rng, rng_device, rng_key
from ckpt.state.unregistered import UnregisteredModels
from runcore import positions as _positions

logger = logging.getLogger("ckpt.manager")  # the manager's messages: one logger to filter

MANAGER_META_KEY = RECORD_KEY
"""Manifest metadata entry where the manager records what it saved (keys, shapes, RNG)."""

Captured = tuple[dict[str, Any], dict[str, Any], list[str]]
"""(state dict, manifest metadata, fresh optimizers) of one step."""


class StateCapture:
    """The state dict and manifest record of a step, for one rank's state objects."""

    def __init__(
        self,
        app: AppState,
        *,
        rank: int,
        world_size: int,
        rng: bool,
        metadata: dict[str, Any] | Callable[[int], dict[str, Any]] | None,
        group: Any,
    ) -> None:
        self.app = app
        self.rank = rank
        self.world_size = world_size
        self.rng = rng
        self._metadata = metadata
        self._group = group
        self._shapes: dict[str, dict[str, list[int]]] | None = None
        self.per_rank_paths: set[str] = set()
        """State paths saved per rank (``ckpt.state.per_rank``): detected or declared."""
        self._param_paths: set[str] | None = None
        self._data_marks: dict[str, tuple[int, int]] = {}
        """Per sampler key: (step, cursor) at the last save or resume (advance() guard)."""
        self._hf: dict[str, Any] | None = None
        self._captured_once = False
        self._unregistered = UnregisteredModels()
        for sampler in self.data_positions().values():
            _positions.claim(sampler)

    def capture(self, step: int, *, reuse_shapes: bool = False) -> Captured:
        """The state dict (RNG included) and manifest metadata of ``step``; the fresh optimizers.

        ``reuse_shapes`` (memory snapshots, every few steps): the models' tensor shapes
        recorded for the shape check are those computed the first time (a module's
        parameters keep their shapes; ``module.state_dict()`` costs ~1 ms per call).
        """
        positions = self._check_data_progress(step)
        if not self._captured_once:
            self._captured_once = True
            self._say_unsaved_positions(step)
        if self.rank == 0:
            self._say_unregistered_models(step)
        if self._hf is None:
            self._hf = {}
            for key, module in self.app.modules.items():
                record = pretrained_record(module)
                if record is not None:
                    self._hf[key] = record
        if not reuse_shapes or self._shapes is None:
            self._shapes = self.app.tensor_shapes()
        fresh = self.app.fresh_optimizers()
        state = self.app.state_dict(skip_optimizers=fresh)
        per_rank.move_out(state, sorted(self.per_rank_paths), self.rank)
        if self.rng:
            state[RNG_STATE_KEY] = {rng_key(self.rank): capture_rng(rng_device())}
        user_meta = self._metadata(step) if callable(self._metadata) else self._metadata
        meta = {
            **(user_meta or {}),
            MANAGER_META_KEY: {
                "keys": sorted(self.app.objects),
                "fresh_optimizers": fresh,
                "rng": self.rng,
                "shapes": self._shapes,
                "per_rank": sorted(self.per_rank_paths),
                **({"data_position": positions} if positions else {}),
                **({"tied": self.app.aliases} if self.app.aliases else {}),
                **({HF_RECORD_KEY: self._hf} if self._hf else {}),
            },
        }
        return state, meta, fresh

    def _say_unregistered_models(self, step: int) -> None:
        """WARNING (rank 0) for an EMA-like model that changed between the first two saves
        but is in no manager's state (:mod:`ckpt.state.unregistered`)."""
        for name in self._unregistered.observe(self.app.modules.values()):
            logger.warning(
                "rank 0 step %d: a%s %s (an EMA copy of a model?) changed since the last save "
                "but is not in the checkpoint state: after a resume it starts again from the "
                "script's fresh copy (its average and n_averaged lost). Put it in the state: "
                "CheckpointManager(root, {..., \"ema\": ema})",
                step, "n" if name[:1] in "AEIOU" else "", name,
            )  # fmt: skip

    def _say_unsaved_positions(self, step: int) -> None:
        """WARNING (rank 0) for each data position that moved but is in no manager's state."""
        if self.rank != 0:
            return
        for position in _positions.unclaimed_moved():
            cursor = int(position.data_position()["cursor"])
            logger.warning(
                "rank 0 step %d: %s %s at sample cursor %d is in no checkpoint manager's "
                "state: after a restart it starts again at sample 0 and the run replays "
                "its data. Put it in the state: CheckpointManager(root, {..., \"sampler\": "
                "sampler})",
                step, "an" if type(position).__name__[:1] in "AEIOU" else "a",
                type(position).__name__, cursor,
            )  # fmt: skip

    def detect_per_rank(self, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Find plain tensors that differ across ranks; save them per rank (collective).

        One all_gather of per-tensor crc32c strings through the checkpoint group, in the
        caller's thread with no save in flight. Compared: module buffers, tensors of
        Statefuls and plain values. Not compared (replicated by construction, and the
        bulk of the bytes: a DDP model would copy every parameter to host per save):
        module parameters and optimizer state; declare those :class:`PerRank` if they
        differ. Tensors under :class:`PerRank` keys are per rank without comparing.
        Paths found stay per rank for the rest of the run.
        """
        tensors = per_rank.plain_tensors(state, skip=(RNG_STATE_KEY, per_rank.PER_RANK_KEY))
        top = {path: path.split(per_rank.PATH_SEP, 1)[0] for path in tensors}
        found = {path for path in tensors if top[path] in self.app.per_rank}
        if self.world_size > 1:
            params = self._parameter_paths()
            compared = {
                path: t
                for path, t in tensors.items()
                if top[path] not in self.app.optimizers and path not in params
            }
            mine = per_rank.digests(compared)
            found |= per_rank.differing(_dist.Collective(self._group).all_gather(mine))
        new = sorted(found - self.per_rank_paths)
        if not new:
            return
        per_rank.move_out(state, new, self.rank)
        self.per_rank_paths |= set(new)
        meta[MANAGER_META_KEY]["per_rank"] = sorted(self.per_rank_paths)
        if self.rank == 0:
            logger.warning(
                "rank 0: saving per rank (they differ between ranks or are declared PerRank): %s",
                ", ".join(new[:8]) + (f" and {len(new) - 8} more" if len(new) > 8 else ""),
            )

    def per_rank_layout(self, record: dict[str, Any], saved_world: int) -> tuple[list[str], int]:
        """Which per-rank paths a checkpoint holds and whose copy this rank loads (and say so)."""
        paths = [str(p) for p in record.get("per_rank", [])]
        self.per_rank_paths = set(paths)
        source = per_rank.source_rank(self.rank, int(saved_world), self.world_size)
        if paths and int(saved_world) != self.world_size and self.rank == 0:
            logger.warning(
                "rank 0: per-rank state %s was saved by %d ranks and is loaded by %d: rank r "
                "takes the copy of saved rank r %% %d",
                ", ".join(paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else ""),
                saved_world, self.world_size, saved_world,
            )  # fmt: skip
        return paths, source

    def mark_resumed(self, step: int) -> None:
        """After a resume: each sampler's cursor is where ``step`` left it."""
        for key, sampler in self.data_positions().items():
            self._data_marks[key] = (int(step), int(sampler.data_position()["cursor"]))

    def _parameter_paths(self) -> set[str]:
        """State paths of module parameters (``model/fc.weight``), computed once."""
        if self._param_paths is None:
            self._param_paths = {
                f"{key}{per_rank.PATH_SEP}{name}"
                for key, module in self.app.modules.items()
                for name, _ in module.named_parameters()
            }
        return self._param_paths

    def data_positions(self) -> dict[str, Any]:
        """Stateful data positions in the state (``elastic.ElasticSampler``: ``data_position()``)."""
        return {
            key: obj
            for key, obj in self.app.statefuls.items()
            if callable(getattr(obj, "data_position", None))
        }

    def _check_data_progress(self, step: int) -> dict[str, Any]:
        """Refuse a save whose steps advanced while a sampler's cursor did not (all ranks).

        A forgotten ``sampler.advance()`` otherwise replays the same data after every
        restart without a sign. The cursor is global, so every rank decides the same.
        Returns each sampler's data position for the manifest.
        """
        positions = {}
        for key, sampler in self.data_positions().items():
            position = sampler.data_position()
            last_step, last_cursor = self._data_marks.get(key, (0, 0))
            if step > last_step and int(position["cursor"]) == last_cursor:
                raise DataPositionError(
                    f"rank {self.rank} step {step}: state[{key!r}] did not advance since step "
                    f"{last_step} (its cursor stayed at {last_cursor}); call "
                    f"{key}.advance() once per optimizer step, or a restart replays the same "
                    "samples. Nothing was saved."
                )
            self._data_marks[key] = (step, int(position["cursor"]))
            positions[key] = position
        return positions
