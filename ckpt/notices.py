"""What a :class:`~ckpt.manager.CheckpointManager` tells its user about their loop.

Rank 0's WARNINGs for mistakes that lose work without an error: a scheduler left out
of the state (its schedule restarts at every resume), nothing saved periodically under
torchrun restarts, a loop that goes on after its ``final`` save, a close with steps in
no checkpoint. Each is said once, from facts the manager has at hand.
"""

from __future__ import annotations

import logging
import sys

from ckpt import env as _env
from ckpt.loading import fresh_start
from ckpt.options import CheckpointOptions

logger = logging.getLogger("ckpt.manager")


def say_start(
    root: str, options: CheckpointOptions, retention: str, unsaved_schedulers: list[str]
) -> None:
    """Rank 0's start-up lines: retention once per job (its first attempt), a WARNING when
    torchrun may restart the job but nothing saves periodically, and one per state key
    stepped by an LR scheduler that is not in the state."""
    if _env.run_identity()[1] == 0:
        logger.warning("rank 0: checkpoints under %s: %s", root, retention)
    else:
        logger.info("rank 0: checkpoints under %s: %s", root, retention)
    restarts = _env.max_restarts()
    if restarts > 0 and not options.saves_periodically:
        logger.warning("rank 0: %s", fresh_start.no_periodic_save_message(restarts))
    for key in unsaved_schedulers:
        logger.warning(
            "rank 0: state[%r] is stepped by an LR scheduler that is not in the checkpoint "
            "state: after a resume its schedule (warm-up included) starts over. Add the "
            'scheduler: CheckpointManager(root, {..., "sched": scheduler})',
            key,
        )


class LoopNotices:
    """The steps a loop offered to ``maybe_save``, and what they say at the end."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.last_step: int | None = None
        self.final_step: int | None = None
        self._said_after_final = False

    def offered(self, step: int, *, final: bool) -> None:
        """``maybe_save(step, final=...)`` was called: WARNING (once) when a loop goes on
        after its ``final`` save (an epoch loop over the endless step loader, or a
        ``final`` flag computed wrong)."""
        if self.final_step is not None and step > self.final_step and not self._said_after_final:
            self._said_after_final = True
            if self.rank == 0:
                logger.warning(
                    "rank 0 step %d: training goes on after the final save at step %d "
                    "(maybe_save(final=True)). An epoch loop over sampler.loader() never "
                    "ends: use sampler.epoch_loader() for `for batch in loader` epochs",
                    step, self.final_step,
                )  # fmt: skip
        self.last_step = step
        if final:
            self.final_step = step

    def closing(self, committed: int | None) -> None:
        """WARNING (rank 0) at a normal close when the last steps given to ``maybe_save``
        are newer than the newest commit: a loop that never passed ``final=True`` (or
        called ``save``) loses them, and a relaunch starts before them."""
        last = self.last_step
        if sys.exc_info()[0] is not None:  # closed by an __exit__ on the way out of an error
            return
        if self.rank != 0 or last is None or self.final_step is not None:
            return
        if committed is not None and committed >= last:
            return
        logger.warning(
            "rank 0: closing after step %d, but the newest checkpoint is %s: the steps since "
            "are in no checkpoint and a relaunch repeats them. Pass final=True to the last "
            "maybe_save (maybe_save(step, final=step == max_steps)) or call save(step) before "
            "close",
            last, "none" if committed is None else f"step {committed}",
        )  # fmt: skip
